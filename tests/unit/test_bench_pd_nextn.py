"""`kvstrata bench pd --speculative-algorithm NEXTN`'s arms and summary, with the PD runs
faked (the real run starts three processes per arm: benchmarks, not unit tests)."""
from __future__ import annotations

import argparse

from kvstrata.bench.pd_nextn import SPEC, run_nextn


def test_two_arms_per_backend_and_their_ratio():
    calls = []

    def fake_pd(args, backend, log_dir, both_extra=(), decode_env=None, tag=""):
        calls.append((backend, both_extra, decode_env, tag))
        arm = "seed" if decode_env is None else "recomputed"
        tpot = 10.0 if arm == "seed" else 12.5
        return {"tpot_ms": {"p50": tpot, "p99": tpot}, "ttft_ms": {"p50": 1.0, "p99": 2.0},
                "output_throughput": 100.0,
                "decode_load": {"avg_spec_accept_length": 1.5,
                                f"spec_dsa_seed_{'used' if arm == 'seed' else arm}": 5,
                                "disagg_metadata_bytes_received_total": 2500}}

    args = argparse.Namespace(model="/m", backends=["tcp", "mooncake"], num_prompts=4)
    out = run_nextn(args, "/tmp", fake_pd)
    assert [c[0] for c in calls] == ["tcp", "tcp", "mooncake", "mooncake"]
    assert all(c[1] == SPEC for c in calls)
    assert [c[2] for c in calls[:2]] == [None, {"KVSTRATA_PD_DSA_SEED": "0"}]
    tcp = out["tcp_nextn"]
    assert tcp["tpot_p50_recompute_over_seed"] == 1.25
    assert tcp["seed"]["seed_outcomes"] == {"used": 5}
    assert tcp["recompute"]["seed_outcomes"] == {"recomputed": 5}
    assert tcp["seed"]["metadata_bytes_per_request"] == 500  # 4 prompts + the warm-up
