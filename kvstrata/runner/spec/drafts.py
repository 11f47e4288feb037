"""Which draft a runner builds for `--speculative-algorithm` (NGRAM needs none: the engine
drafts from its n-gram cache)."""
from __future__ import annotations

import torch

from kvstrata.runner.models.decoder import is_llama_family
from kvstrata.runner.models.registry import architecture_name
from kvstrata.runner.spec.standalone import DraftModel


# The recurrent models whose MTP layer NEXTN drafts with (runner/spec/mtp_hybrid.py); the
# resolution rule's list (config/rules/recurrent.py) is the same.
MTP_HYBRIDS = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


def build_draft(target, device: torch.device, dtype: str, path: str | None, algorithm: str,
                quantization: str | None, tree: tuple[int, int], token_map: str | None,
                target_source, dsa_fused_topk: bool,
                deterministic: bool = False) -> DraftModel | None:
    """STANDALONE: a second checkpoint. EAGLE / EAGLE3: a head over a llama-family target;
    over a DeepSeek (MLA), Qwen3-Next, Qwen3.5 or Qwen3.5-MoE target, EAGLE is NEXTN after
    resolution: its own MTP layer (a rank's share of it under TP for the hybrids)."""
    if path is None:
        return None
    refuse_speculation(target, algorithm)
    if algorithm in ("EAGLE", "EAGLE3") and target.pool_kind == "mla":
        from kvstrata.runner.spec.mtp import MTPDraft

        if hasattr(target, "full_dims"):
            raise NotImplementedError("not implemented yet: NEXTN (the MTP layer as an EAGLE "
                                      "draft) with --tp-size > 1")

        if deterministic:  # its layer and head run torch's matmuls (deepseek_mtp.py)
            raise NotImplementedError("not implemented yet: --enable-deterministic-inference "
                                      "with NEXTN (the MTP layer as a draft)")
        if algorithm == "EAGLE3" or token_map is not None:
            raise NotImplementedError(f"not implemented yet: --speculative-algorithm "
                                      f"{algorithm}{' with a token map' if token_map else ''} "
                                      f"on {type(target).__name__} (NEXTN drafts with its "
                                      f"MTP layer)")
        return MTPDraft(path, target, device, tree, dsa_fused_topk)
    arch = architecture_name(target.config)
    if algorithm in ("EAGLE", "EAGLE3") and arch in MTP_HYBRIDS:
        from kvstrata.runner.spec.mtp_hybrid import Qwen3NextMTPDraft

        if algorithm == "EAGLE3" or token_map is not None:
            raise NotImplementedError(f"not implemented yet: --speculative-algorithm "
                                      f"{algorithm}{' with a token map' if token_map else ''} "
                                      f"on {arch} (NEXTN drafts with its MTP layer)")
        return Qwen3NextMTPDraft(path, target, device, tree)
    if algorithm in ("EAGLE", "EAGLE3"):
        from kvstrata.runner.spec.eagle import EagleDraft

        return EagleDraft(path, target, device, tree, token_map, target_source, algorithm,
                          deterministic)
    # A tensor-parallel target's dims are its rank's share (a vocabulary slice): the draft,
    # whole on every rank, must match the whole vocabulary.
    vocab = getattr(target, "full_dims", target.dims).vocab_size
    draft = DraftModel(path, dtype, device, quantization, vocab, tree, deterministic)
    if getattr(draft.model, "num_recurrent_layers", 0):
        raise ValueError(f"--speculative-draft-model-path {path}: a draft model with recurrent "
                         f"(SSM / linear-attention) layers is not built (its state would have "
                         f"to be rolled back to the accepted step after every verify); use a "
                         f"draft without them")
    return draft


def refuse_speculation(target, algorithm: str) -> None:
    """EAGLE / EAGLE3 heads read the hidden states the llama-family decoder's forward keeps
    (capture_hidden, capture_layers); gpt-oss runs that forward too. Gemma's own forward
    keeps none: refused by name. NGRAM and STANDALONE only run the target's forward over
    draft tokens, which any decoder does."""
    if (algorithm in ("EAGLE", "EAGLE3") and getattr(target, "spec", None) is not None
            and not (is_llama_family(target) or target.spec.family == "gpt_oss")):
        raise ValueError(f"--speculative-algorithm {algorithm}: EAGLE heads are not "
                         f"implemented for {architecture_name(target.config)} targets (the "
                         f"llama-family decoder and gpt-oss have them; NGRAM and STANDALONE "
                         f"work)")


__all__ = ["build_draft", "refuse_speculation"]
