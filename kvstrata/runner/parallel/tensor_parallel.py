"""Tensor parallelism for the llama-family decoder over torch.distributed: the
model-parallel layers (the serving path: tp_runner.py).

Megatron's split, as SGLang and vLLM do it, one process per rank:
  - q/k/v (merged) and gate/up are column-parallel: a rank holds its heads' rows of
    q_proj, k_proj, v_proj and its slice of the MLP width; attention runs on its own heads;
  - o_proj and down_proj are row-parallel: a rank holds the matching input columns, the
    partial outputs are summed over ranks (all-reduce) before the residual add; a bias is
    added once (rank 0 holds it, the others zeros);
  - KV heads split across ranks; when tp_size > num_key_value_heads each KV head is
    replicated on the tp_size / num_kv_heads ranks whose query heads read it (SGLang's rule);
  - the embedding and the LM head are vocab-parallel: a rank holds ceil(V / tp) rows (the
    last padded with zeros); a lookup of a token outside the rank's rows gives zeros, and the
    all-reduce sums the one rank that has it; logits are all-gathered along the vocabulary
    where sampling runs (every rank, so every rank samples the same token).
Norms and rotary tables are replicated. The all-reduce sums partial matmuls, so logits equal
the one-rank model's up to float summation order (tests/correctness/test_tensor_parallel.py).
On CPU the group is gloo; the same calls take NCCL/RCCL on a GPU.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvstrata.config.hf_config import ModelDims
from kvstrata.runner.models.decoder import ArchSpec, DecoderForCausalLM


class TPGroup:
    """This process's rank in a torch.distributed group (initialised by the caller). Counts
    the seconds spent in the model's collectives (waits for slower ranks included): the
    benchmark reports them as a share of the step."""

    def __init__(self, rank: int, size: int, group: Any = None):
        self.rank, self.size, self.group = rank, size, group
        self.comm_seconds, self.comm_calls = 0.0, 0
        # Ranks on one x86 CPU: a shared-memory all-reduce (runner/parallel/shm_allreduce.py)
        # for tensors that fit its slots; torch.distributed for the rest.
        self.shm: Any = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            start = time.perf_counter()
            if self.shm is not None and self.shm.fits(t):
                self.shm.all_reduce(t)
            else:
                dist.all_reduce(t, group=self.group)
            self.comm_seconds += time.perf_counter() - start
            self.comm_calls += 1
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """[..., n] from every rank -> [..., size * n], rank order."""
        if self.size == 1:
            return t
        start = time.perf_counter()
        if self.shm is not None and self.shm.fits(t):
            out = self.shm.all_gather_last(t)
        else:
            parts = [torch.empty_like(t) for _ in range(self.size)]
            dist.all_gather(parts, t.contiguous(), group=self.group)
            out = torch.cat(parts, dim=-1)
        self.comm_seconds += time.perf_counter() - start
        self.comm_calls += 1
        return out


def even_split(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """The [lo, hi) of n units (heads, experts, columns) rank `rank` of `size` holds; `what`
    names them in the refusal when size does not divide n."""
    if n % size:
        raise ValueError(f"--tp-size {size} must divide {what} {n}")
    return rank * n // size, (rank + 1) * n // size


def vocab_rows(vocab_size: int, rank: int, size: int) -> tuple[tuple[int, int], int]:
    """The [lo, hi) vocabulary rows a rank holds, and its table's row count (ceil(V / tp))."""
    rows = -(-vocab_size // size)
    return (min(rank * rows, vocab_size), min((rank + 1) * rows, vocab_size)), rows


def vocab_parallel_embed(group: TPGroup, ids: torch.Tensor, table: torch.Tensor,
                         lo: int, hi: int) -> torch.Tensor:
    """Rows lo..hi-1 of the embedding are `table`'s: other ids look up zeros here, and the
    all-reduce adds the one rank that holds each row."""
    mine = (ids >= lo) & (ids < hi)
    x = F.embedding(torch.where(mine, ids - lo, 0), table)
    return group.all_reduce(x * mine[:, None].to(x.dtype))


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """This rank's rows of an embedding / head, zero-padded to the table's `rows` (the last
    rank's share of a vocabulary that tp does not divide)."""
    pad = rows - t.shape[0]
    return F.pad(t, (0, 0, 0, pad)) if pad else t


@dataclass(frozen=True)
class TPShard:
    """Which slice of each dimension rank `rank` of `size` holds ([lo, hi) ranges)."""
    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]
    vocab: tuple[int, int]   # real rows; the local table has vocab_rows rows
    vocab_rows: int

    @classmethod
    def plan(cls, d: ModelDims, rank: int, size: int) -> "TPShard":
        nq, nkv = d.num_heads, d.num_kv_heads
        if nq % size:
            raise ValueError(f"--tp-size {size} must divide num_attention_heads {nq}")
        if d.intermediate_size % size:
            raise ValueError(f"--tp-size {size} must divide intermediate_size "
                             f"{d.intermediate_size}")
        q = nq // size
        if nkv >= size:
            if nkv % size:
                raise ValueError(f"--tp-size {size} must divide num_key_value_heads {nkv}")
            kv = (rank * nkv // size, (rank + 1) * nkv // size)
        else:  # replicated: the one KV head this rank's query heads read
            if size % nkv:
                raise ValueError(f"num_key_value_heads {nkv} must divide --tp-size {size}")
            head = rank * nkv // size
            kv = (head, head + 1)
        vocab, rows = vocab_rows(d.vocab_size, rank, size)
        m = d.intermediate_size // size
        return cls(rank, size, (rank * q, (rank + 1) * q), kv, (rank * m, (rank + 1) * m),
                   vocab, rows)

    def local_dims(self, d: ModelDims) -> ModelDims:
        return dataclasses.replace(
            d, num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.mlp[1] - self.mlp[0], vocab_size=self.vocab_rows)


class TPDecoderForCausalLM(DecoderForCausalLM):
    """One rank's share of a llama-family decoder (load it with the usual loader: every
    checkpoint tensor is sliced to this rank's share in load_weight)."""

    def __init__(self, config: Any, spec: ArchSpec, dtype: torch.dtype, device: torch.device,
                 group: TPGroup):
        full = ModelDims.from_config(config)
        shard = TPShard.plan(full, group.rank, group.size)
        super().__init__(config, spec, dtype, device, dims=shard.local_dims(full))
        self.full_dims, self.shard, self.group = full, shard, group

    # ---- forward: the vocab-parallel ends and the row-parallel sums
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embed(self.group, ids, self.embed, *self.shard.vocab)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        local = self.linear(x, self.lm_head).float()
        return self.group.all_gather_last(local)[:, :self.full_dims.vocab_size]

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(partial)

    def max_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """Quantisation's smoothing: a column-parallel weight's per-input-channel maximum
        over all ranks' rows (runner/quant/smoothing.py)."""
        return self.group.all_reduce_max(t)

    # ---- loading: read only this rank's part of each tensor (runner/models/loader.py)
    def read_spec(self, name: str):
        s, hd = self.shard, self.full_dims.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return ("rows", *s.vocab)
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            return "all"
        proj, kind = parts[4], parts[-1]
        if proj in ("qkv_proj", "gate_up_proj"):  # Phi-3: no per-rank slicing of these yet
            raise ValueError(f"--tp-size > 1 is not supported for checkpoints with fused "
                             f"{proj} weights (Phi-3); serve them with --tp-size 1")
        heads = {"q_proj": s.q_heads, "k_proj": s.kv_heads, "v_proj": s.kv_heads}
        if proj in heads:  # column-parallel: this rank's heads' rows (weight and bias)
            return ("rows", heads[proj][0] * hd, heads[proj][1] * hd)
        if proj in ("gate_proj", "up_proj"):
            return ("rows", *s.mlp)
        if proj in ("o_proj", "down_proj") and kind == "weight":  # row-parallel: columns
            return ("cols", *((s.q_heads[0] * hd, s.q_heads[1] * hd) if proj == "o_proj"
                              else s.mlp))
        return "all"  # norms (q_norm / k_norm are per head_dim), row-parallel biases

    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = pad_rows(tensor, self.shard.vocab_rows)
        elif name.endswith(("o_proj.bias", "down_proj.bias")) and self.shard.rank:
            tensor = torch.zeros_like(tensor)  # a row-parallel bias is added once
        return super().load_weight(name, tensor)


__all__ = ["TPDecoderForCausalLM", "TPGroup", "TPShard", "even_split", "vocab_parallel_embed",
           "vocab_rows", "pad_rows"]
