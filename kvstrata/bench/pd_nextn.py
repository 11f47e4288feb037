"""`kvstrata bench pd --speculative-algorithm NEXTN`: PD with both servers drafting with the
model's MTP layer, per transfer backend, twice in the same run: the decode server's first
draft rounds attend to the prefill's DSA top-k seed (`seed`), or ignore it and run the
indexer (`recompute`, KVSTRATA_PD_DSA_SEED=0). Reported per arm: decode TPOT p50 / p99, the
accept length, the seed outcomes and the transfer metadata bytes per request, and the TPOT
ratio recompute / seed. `--model tiny-dsa-mtp` builds the tiny random-weight DSA model with
an MTP layer (kvstrata/bench/tiny_dsa.py): its drafts are nearly always rejected, so the
accept length is ~1 and the ratio isolates what the seed saves."""
from __future__ import annotations

import os

TINY = "tiny-dsa-mtp"
SPEC = ("--speculative-algorithm", "NEXTN", "--speculative-disable-by-batch-size", "1024")


def run_nextn(args, log_dir: str, disaggregated) -> dict:
    if args.model == TINY:
        from kvstrata.bench.tiny_dsa import build_bench_model  # noqa: PLC0415

        cache = os.path.expanduser("~/.cache/kvstrata-bench")
        os.makedirs(cache, exist_ok=True)
        args.model = build_bench_model(os.path.join(cache, TINY + "-v2"))
    out: dict = {}
    for backend in args.backends:
        arms = {}
        for arm, env in (("seed", None), ("recompute", {"KVSTRATA_PD_DSA_SEED": "0"})):
            s = disaggregated(args, backend, log_dir, both_extra=SPEC, decode_env=env,
                              tag=f"-nextn-{arm}")
            load = s["decode_load"]
            requests = args.num_prompts + 1  # and the warm-up
            arms[arm] = {
                "tpot_ms": s["tpot_ms"], "ttft_ms": s["ttft_ms"],
                "output_throughput": s["output_throughput"],
                "avg_spec_accept_length": load.get("avg_spec_accept_length"),
                "seed_outcomes": {k.removeprefix("spec_dsa_seed_"): v for k, v in load.items()
                                  if k.startswith("spec_dsa_seed_")},
                "metadata_bytes_per_request":
                    load.get("disagg_metadata_bytes_received_total", 0) / requests}
        seed, rec = arms["seed"]["tpot_ms"]["p50"], arms["recompute"]["tpot_ms"]["p50"]
        arms["tpot_p50_recompute_over_seed"] = rec / seed if seed else None
        out[f"{backend}_nextn"] = arms
        print(f"{backend}: TPOT p50 seed {seed:.2f} ms, recompute {rec:.2f} ms "
              f"(x{arms['tpot_p50_recompute_over_seed']:.3f}); accept length "
              f"{arms['seed']['avg_spec_accept_length']}; seeds {arms['seed']['seed_outcomes']}"
              f" / {arms['recompute']['seed_outcomes']}; metadata "
              f"{arms['seed']['metadata_bytes_per_request']:.0f} B/request")
    return out


__all__ = ["run_nextn"]
