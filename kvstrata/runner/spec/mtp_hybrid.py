"""NEXTN on Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: the checkpoint's MTP layer
(runner/models/qwen3_next_mtp.py; Qwen3.5's has the same names and shape, with its model's dense
MLP, Qwen3.5-MoE's with its MoE block) drafts like an EAGLE head
(runner/spec/eagle.py: features from the target's forwards, catch-up extend, one forward per
further draft, validity per slot) over a K/V pool of one layer beside the target's
full-attention pool.

The MTP layer is a full-attention layer: the draft keeps no recurrent state, so nothing of
its own needs rolling back after a verify (its K/V validity per slot is EagleDraft's). The
target's Gated DeltaNet layers verify a chain keeping one state per draft step and commit the
accepted step's (runner/recurrent/backend.py, as for NGRAM and STANDALONE drafts). Chains
only: a recurrent layer verifies one state per step, so trees are refused at start-up. Under
PD it is any EAGLE-family draft (runner/spec/handoff.py): its K/V pages cross beside the
target's pages and the final state slot. Under --tp-size N (Qwen3-Next and Qwen3.5) each
rank's draft is its share of the MTP layer over a K/V pool of its KV heads, beside the rank's
share of the target (qwen3_next_mtp.py); its logits are all-gathered, so every rank drafts the
same tokens and verifies them with its heads' per-step states.
"""
from __future__ import annotations

import torch

from kvstrata.runner.models.qwen3_next_mtp import load_qwen3_next_mtp
from kvstrata.runner.spec.eagle import EagleDraft


class Qwen3NextMTPDraft(EagleDraft):
    def __init__(self, model_path: str, target, device: torch.device,
                 tree: tuple[int, int] = (1, 1)):
        if tree[0] > 1:
            raise NotImplementedError(f"not implemented yet: --speculative-eagle-topk > 1 "
                                      f"with NEXTN on {type(target).__name__} (a recurrent "
                                      f"layer verifies chains only)")
        self.deterministic = False  # refused for recurrent models (rules/deterministic.py)
        self._init_own_layer(model_path, target, device, tree, load_qwen3_next_mtp)

    def tree_forward(self, fb, carry):
        raise NotImplementedError("MTP tree drafts are refused at start-up")


__all__ = ["Qwen3NextMTPDraft"]
