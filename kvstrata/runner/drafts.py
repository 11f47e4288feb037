"""Which draft a runner builds for `--speculative-algorithm` (NGRAM needs none: the engine
drafts from its n-gram cache)."""
from __future__ import annotations

import torch

from kvstrata.runner.draft_model import DraftModel


def build_draft(target, device: torch.device, dtype: str, path: str | None, algorithm: str,
                quantization: str | None, tree: tuple[int, int], token_map: str | None,
                target_source, dsa_fused_topk: bool) -> DraftModel | None:
    """STANDALONE: a second checkpoint. EAGLE / EAGLE3: a head over a llama-family target;
    over a DeepSeek (MLA) target, EAGLE is NEXTN after resolution: its own MTP layer."""
    if path is None:
        return None
    if algorithm in ("EAGLE", "EAGLE3") and target.pool_kind == "mla":
        from kvstrata.runner.mtp_draft import MTPDraft

        if algorithm == "EAGLE3" or token_map is not None:
            raise NotImplementedError(f"not implemented yet: --speculative-algorithm "
                                      f"{algorithm}{' with a token map' if token_map else ''} "
                                      f"on {type(target).__name__} (NEXTN drafts with its "
                                      f"MTP layer)")
        return MTPDraft(path, target, device, tree, dsa_fused_topk)
    if algorithm in ("EAGLE", "EAGLE3"):
        from kvstrata.runner.eagle_draft import EagleDraft

        return EagleDraft(path, target, device, tree, token_map, target_source, algorithm)
    return DraftModel(path, dtype, device, quantization, target.dims.vocab_size, tree)


__all__ = ["build_draft"]
