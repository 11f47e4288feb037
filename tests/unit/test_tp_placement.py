"""Where tensor-parallel ranks run (runner/parallel/tp_comm.TPPlacement): ranks spread evenly
over --nnodes launchers; cores and GPUs go by the rank's index on its machine -- its local
index on a machine of its own, its global rank when every launcher shares this machine (the
store's address is loopback), so two launchers on one box do not both take core 0."""
from __future__ import annotations

from kvstrata.runner.parallel.tp_comm import TPPlacement


def test_ranks_spread_over_launchers_and_index_their_machine():
    remote = [TPPlacement(r, 4, "10.0.0.5:5000", nnodes=2, node_rank=r // 2) for r in range(4)]
    assert [(p.per_node, p.local_index, p.machine_index, p.machine_count) for p in remote] == [
        (2, 0, 0, 2), (2, 1, 1, 2), (2, 0, 0, 2), (2, 1, 1, 2)]
    assert list(remote[3].local_ranks()) == [2, 3] and not remote[0].on_one_machine

    local = [TPPlacement(r, 4, "127.0.0.1:5000", nnodes=2, node_rank=r // 2) for r in range(4)]
    assert all(p.on_one_machine for p in local)
    assert [(p.local_index, p.machine_index, p.machine_count) for p in local] == [
        (0, 0, 4), (1, 1, 4), (0, 2, 4), (1, 3, 4)]

    single = TPPlacement(1, 2, "127.0.0.1:5000")  # one launcher: nothing to share
    assert (single.on_one_machine, single.machine_index, single.machine_count) == (False, 1, 2)
