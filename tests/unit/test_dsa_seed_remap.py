"""The PD seed remap on hand-built req_to_token tables."""
from __future__ import annotations

import torch

from kvstrata.runner.attention.dsa_seed import (batch_seed, checked_seeds, remap_seed_positions_to_slots,
                                                seed_for_decode)


def table():
    t = torch.zeros(4, 8, dtype=torch.int32)  # row 0 reserved
    t[1, :5] = torch.tensor([11, 12, 13, 14, 15])
    t[2, :3] = torch.tensor([21, 22, 0])  # position 2 unallocated
    t[3, :8] = torch.arange(31, 39)
    return t


def remap(seeds, rows, lens):
    return remap_seed_positions_to_slots(torch.tensor(seeds), table(), torch.tensor(rows),
                                         torch.tensor(lens)).tolist()


def test_valid_and_padded():
    assert remap([[0, 4, -1], [7, 0, 3]], [1, 3], [5, 8]) == [[11, 15, -1], [38, 31, 34]]


def test_out_of_range_position_fails_row_closed():
    assert remap([[0, 5, -1], [1, 2, 3]], [1, 3], [5, 8]) == [[-1, -1, -1], [32, 33, 34]]


def test_beyond_table_width_fails_closed():
    assert remap([[8, 0]], [3], [20]) == [[-1, -1]]


def test_unallocated_slot_fails_closed():
    assert remap([[0, 2]], [2], [3]) == [[-1, -1]]


def test_value_below_minus_one_fails_closed():
    assert remap([[0, -2]], [1], [5]) == [[-1, -1]]


def test_row_zero_fails_closed():
    assert remap([[0]], [0], [5]) == [[-1]]


def test_batch_rule():
    assert batch_seed(torch.tensor([[1, -1], [-1, -1]])) is None
    ok = torch.tensor([[1, -1], [2, 3]])
    assert torch.equal(batch_seed(ok), ok)
    assert batch_seed(None) is None


def test_gate_off_passes_positions_through():
    seeds = torch.tensor([[0, 4], [7, 1]])
    out = seed_for_decode(seeds, table(), torch.tensor([1, 3]), torch.tensor([5, 8]), False)
    assert torch.equal(out, seeds)
    on = seed_for_decode(seeds, table(), torch.tensor([1, 3]), torch.tensor([5, 8]), True)
    assert on.tolist() == [[11, 15], [38, 32]]
    bad = seed_for_decode(torch.tensor([[0, 9], [1, 2]]), table(), torch.tensor([1, 3]),
                          torch.tensor([5, 8]), True)
    assert bad is None  # row 0 failed closed -> no seed for the batch


def test_positions_fail_closed_too_when_the_gate_is_off():
    """Passed-through positions are mapped through req_to_token later: a row with an invalid
    entry must not reach that mapping (a position past the request, or below -1)."""
    seeds = torch.tensor([[0, 9], [1, -2], [2, -1]])
    out = checked_seeds(seeds, table(), torch.tensor([1, 3, 1]), torch.tensor([5, 8, 5]), False)
    assert out.tolist() == [[-1, -1], [-1, -1], [2, -1]]
    assert seed_for_decode(seeds, table(), torch.tensor([1, 3, 1]), torch.tensor([5, 8, 5]),
                           False) is None  # the batch rule
