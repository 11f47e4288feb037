"""DSA top-k in both domains: fused (scores -> slots) and unfused (positions, then
req_to_token) select the same slots, and sparse attention over them gives identical outputs,
on ragged batches with lengths below, at and above index_topk."""
from __future__ import annotations

import torch

from kvstrata.runner.attention.dsa_topk import (fused_topk_to_slots, positions_to_slots,
                                               topk_positions)

TOPK = 6


def _ragged_batch(seed: int = 0):
    """Queries of 5 requests (lengths 1..15 visible keys), distinct random slots per row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 3, 6, 7, 15, 2, 11])
    rows = torch.tensor([1, 2, 3, 3, 4, 5, 4])
    width = 16
    table = torch.zeros(6, width, dtype=torch.int64)
    perm = torch.randperm(200, generator=g)[:5 * width] + 1
    table[1:] = perm.view(5, width)
    scores = torch.randn(len(lengths), width, generator=g)
    return scores, lengths, rows, table


def test_padding_rule_and_domains_agree():
    scores, lengths, rows, table = _ragged_batch()
    positions = topk_positions(scores, lengths, TOPK)
    for t, n in enumerate(lengths.tolist()):
        row = positions[t].tolist()
        if n <= TOPK:
            assert row == list(range(n)) + [-1] * (TOPK - n)  # first `length`, -1 after
        else:
            visible = scores[t, :n]
            assert sorted(row) == sorted(visible.topk(TOPK).indices.tolist())
    unfused = positions_to_slots(positions, table, rows)
    fused = fused_topk_to_slots(scores, lengths, table[rows], TOPK)
    assert torch.equal(fused, unfused)
    assert ((fused == -1) == (positions == -1)).all()
    assert (fused[fused >= 0] > 0).all()  # never the padding sink


def test_sparse_attention_output_equal_in_both_domains():
    from kvstrata.runner.attention.dsa_sparse import DSASparseMLABackend

    scores, lengths, rows, table = _ragged_batch(seed=3)
    g = torch.Generator().manual_seed(5)
    latents = torch.randn(220, 10, generator=g)
    q = torch.randn(len(lengths), 3, 10, generator=g)
    backend = DSASparseMLABackend(None, None, kv_lora_rank=7, index_topk=TOPK,
                                  index_head_dim=4, scaling=0.3)
    fused = backend.attend(q, latents, fused_topk_to_slots(scores, lengths, table[rows], TOPK))
    unfused = backend.attend(q, latents, positions_to_slots(
        topk_positions(scores, lengths, TOPK), table, rows))
    assert torch.equal(fused, unfused)
    # And it is the masked softmax over exactly the selected rows (a torch reference).
    slots = fused_topk_to_slots(scores, lengths, table[rows], TOPK)
    for t in range(len(lengths)):
        sel = slots[t][slots[t] >= 0]
        keys = latents[sel]
        probs = torch.softmax(q[t] @ keys.T * 0.3, dim=-1)
        torch.testing.assert_close(fused[t], probs @ keys[:, :7], atol=1e-6, rtol=0)


def test_short_score_rows_pad_to_topk():
    # Fewer keys than topk in the whole batch: every row is "short".
    scores = torch.randn(2, 3)
    lengths = torch.tensor([2, 3])
    table = torch.tensor([[0, 5, 6, 7]])
    rows = torch.zeros(2, dtype=torch.int64)
    assert topk_positions(scores, lengths, 4).tolist() == [[0, 1, -1, -1], [0, 1, 2, -1]]
    assert fused_topk_to_slots(scores, lengths, table[rows], 4).tolist() == [
        [0, 5, -1, -1], [0, 5, 6, -1]]
    assert positions_to_slots(topk_positions(scores, lengths, 4), table, rows).tolist() == [
        [0, 5, -1, -1], [0, 5, 6, -1]]
