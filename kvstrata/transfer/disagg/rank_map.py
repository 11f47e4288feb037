"""Which prefill rank a decode rank pulls its KV from when both servers run tensor
parallelism, possibly at different sizes (SGLang maps them by the attention-TP ratio).

Equal sizes: decode rank r pulls from prefill rank r (each holds the same share of the KV
heads). Different sizes work only for a KV every rank holds whole -- MLA's latent (and the
DSA indexer keys) are replicated over the ranks -- because then any prefill rank has what
any decode rank needs:
  prefill P > decode D: decode rank d pulls from prefill rank d and tells the prefill ranks
      d + D, d + 2D, ... that nothing is wanted from them ("silent" ranks, SGLang's dummy
      destinations), so their half of the room ends when the prompt is computed;
  prefill P < decode D: decode rank d pulls from prefill rank d % P, so prefill rank p
      sends every page to each of its `fanout` decode ranks p, p + P, ...
An MHA model (its KV heads split over the ranks) at different sizes is refused by name; with
hybrid SWA memory (an SWA pool beside it, split over the ranks alike) with SGLang's message.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankRoute:
    """What decode rank `decode_rank` needs from a prefill server of `prefill_size` ranks."""
    source: int                  # the prefill rank whose pages it receives
    fanout: int                  # how many decode ranks the source sends the room to
    silent: tuple[int, ...] = ()  # prefill ranks told to send nothing


SWA_MISMATCH = "PD state transfer does not support TP-mismatched non-MLA SWA models"


def rank_route(decode_rank: int, decode_size: int, prefill_size: int,
               kv_replicated: bool, swa: bool = False) -> RankRoute:
    """ValueError (the reason) when the two sizes cannot exchange KV. `swa`: the KV has an
    SWA pool's region (hybrid SWA memory, never replicated: SGLang's refusal)."""
    if not 0 <= decode_rank < decode_size or prefill_size < 1:
        raise ValueError(f"decode rank {decode_rank} of {decode_size}, prefill size "
                         f"{prefill_size}: not a tensor-parallel layout")
    if prefill_size == decode_size:
        return RankRoute(decode_rank, 1)
    if swa and not kv_replicated:
        raise ValueError(f"{SWA_MISMATCH} (prefill --tp-size {prefill_size} != decode "
                         f"--tp-size {decode_size}: run both servers at the same --tp-size)")
    if not kv_replicated:
        raise ValueError(
            f"prefill --tp-size {prefill_size} != decode --tp-size {decode_size}: PD between "
            f"different tensor-parallel sizes needs a KV cache every rank holds whole (MLA); "
            f"this model splits its KV heads over the ranks, so run both servers at the same "
            f"--tp-size")
    if prefill_size > decode_size:
        silent = tuple(range(decode_rank + decode_size, prefill_size, decode_size))
        return RankRoute(decode_rank, 1, silent)
    source = decode_rank % prefill_size
    return RankRoute(source, len(range(source, decode_size, prefill_size)))


__all__ = ["RankRoute", "SWA_MISMATCH", "rank_route"]
