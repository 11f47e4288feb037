"""Speculative decoding vs plain decoding, same model, same prompts, same run.

    kvstrata bench spec                               # SmolLM2, batch 1, 4, 32
    kvstrata bench spec --batch-sizes 1 --output-len 64 --workloads repeat
    kvstrata bench spec --algorithms NGRAM STANDALONE  # STANDALONE: the model's w8a8 self

Two workloads of chat prompts (SmolLM2's chat template):
  chat    varied questions (answers rarely quote anything);
  repeat  answers that quote or edit the prompt (repeat / rewrite a passage of this repo's
          docs), what n-gram drafts are for.
For each workload and batch size B, B requests run together (greedy, fixed output length)
once without speculation and once per algorithm, interleaved, each run with an empty prefix
cache and an empty n-gram cache (a repeated request would be drafted from its own earlier
answer); reported: output tok/s of the
batch, TPOT p50 (per request: time between its first and last token / (tokens - 1)), the
accept length (tokens per verify pass) and the ratios to plain decoding. Greedy outputs are
checked equal to plain decoding's (a mismatch is reported, not hidden).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from kvstrata.bench.box_load import add_quiet_arg, announce_load

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis to a child.",
    "Give three tips for writing clean code.", "Why is the sky blue?",
    "Write a haiku about autumn.", "What does a CPU cache do?",
    "Describe the water cycle.", "How do vaccines work?",
    "Suggest a name for a bakery.", "What is the difference between a list and a tuple?",
    "Summarise the plot of Romeo and Juliet.", "How can I sleep better?",
]
EDITS = ["Repeat the following text exactly:\n\n{p}",
         "Rewrite the following text, replacing every 'the' with 'THE':\n\n{p}",
         "Copy this passage and add a title line above it:\n\n{p}"]


def _passages(n: int) -> list[str]:
    root = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "architecture.md")
    try:
        with open(root, encoding="utf-8") as fh:
            words = fh.read().split()
    except OSError:  # installed without the docs: any fixed prose will do
        words = (__doc__ or "").split() * 20
    return [" ".join(words[i * 60:(i * 60) + 60]) for i in range(n)]


def workload(name: str, n: int) -> list[list[dict]]:
    if name == "chat":
        return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]
    return [[{"role": "user", "content": EDITS[i % len(EDITS)].format(p=p)}]
            for i, p in enumerate(_passages(n))]


def _run_batch(llm, prompts: list[list[int]], output_len: int) -> dict:
    """All prompts at once through the engine; per-request token times."""
    from kvstrata.engine.request import EngineRequest
    from kvstrata.protocol import SamplingParams

    engine = llm.engine
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    outs: dict[str, list[int]] = {}
    metas: dict[str, object] = {}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        rid = f"b{time.monotonic_ns()}-{i}"
        outs[rid] = []
        engine.add_request(EngineRequest(rid, p, SamplingParams(
            max_new_tokens=output_len, temperature=0, ignore_eos=True)))
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.rid not in outs:
                continue
            if not outs[out.rid]:
                first[out.rid] = now
            outs[out.rid] += out.new_token_ids
            last[out.rid] = now
            if out.finished:
                metas[out.rid] = out.spec
    elapsed = time.perf_counter() - start
    tpots = [(last[r] - first[r]) / (len(t) - 1) for r, t in outs.items() if len(t) > 1]
    specs = [m for m in metas.values() if m is not None]
    verify = sum(m.verify_ct for m in specs)
    accepted = sum(m.accepted_drafts for m in specs)
    return {"tok_s": sum(len(t) for t in outs.values()) / elapsed,
            "tpot_p50_ms": 1000 * statistics.median(tpots) if tpots else None,
            "ttft_p50_ms": 1000 * (statistics.median(first.values()) - start),
            "accept_length": (verify + accepted) / verify if verify else None,
            "outputs": list(outs.values())}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto",
                    help="target (and draft) compute dtype, as serve's --dtype")
    ap.add_argument("--algorithms", nargs="+", default=["NGRAM"])
    ap.add_argument("--num-draft-tokens", type=int, default=8, help="NGRAM")
    ap.add_argument("--ngram-breadth", type=int, default=None,
                    help="NGRAM --speculative-ngram-max-bfs-breadth (default: a chain)")
    ap.add_argument("--ngram-match-type", default="BFS", choices=["BFS", "PROB"])
    ap.add_argument("--draft-model", default=None,
                    help="STANDALONE draft checkpoint (default: --model itself)")
    ap.add_argument("--eagle-head", default=None,
                    help="EAGLE: the LlamaForCausalLMEagle head checkpoint for --model")
    ap.add_argument("--token-map", default=None,
                    help="EAGLE: --speculative-token-map (FR-Spec hot tokens), a second "
                         "EAGLE setup beside the full-vocabulary one")
    ap.add_argument("--draft-quantization", default="w8a8_int8",
                    help="STANDALONE draft quantization (unquant: none)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="--speculative-disable-by-batch-size (default: the measured gate)")
    ap.add_argument("--draft-steps", type=int, default=3,
                    help="STANDALONE / EAGLE --speculative-num-steps (draft tokens = "
                         "steps + 1)")
    ap.add_argument("--workloads", nargs="+", default=["chat", "repeat"],
                    choices=["chat", "repeat"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 32])
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--reps", type=int, default=1, help="batches per setting (interleaved)")
    ap.add_argument("--warmup-reps", type=int, default=1,
                    help="unmeasured batches per setting first (each engine's one-time costs: "
                         "the speculation gate's warm-up probes, first-call allocations)")
    ap.add_argument("--output-json", default="benchmarks/results/spec.json")
    add_quiet_arg(ap)


def run(args: argparse.Namespace) -> dict:
    from kvstrata import LLM
    from kvstrata.engine.sides.registry import spec_side

    load = announce_load(args.require_quiet)
    common = {"page_size": 16, "max_total_tokens": 65536, "dtype": args.dtype}
    engines = {"plain": LLM(model_path=args.model, **common)}
    setups: list[tuple[str, str, dict]] = []  # (row name, algorithm, its flags)
    for algo in args.algorithms:
        if algo == "STANDALONE":
            shape = {"speculative_draft_model_path": args.draft_model or args.model,
                     "speculative_draft_model_quantization": args.draft_quantization,
                     "speculative_num_steps": args.draft_steps}
        elif algo in ("EAGLE", "EAGLE3"):
            if args.eagle_head is None:
                raise SystemExit("--algorithms EAGLE needs --eagle-head (an EAGLE-2 head "
                                 "checkpoint trained for --model)")
            shape = {"speculative_draft_model_path": args.eagle_head,
                     "speculative_num_steps": args.draft_steps}
        else:
            shape = {"speculative_num_draft_tokens": args.num_draft_tokens,
                     "speculative_ngram_max_bfs_breadth": args.ngram_breadth,
                     "speculative_ngram_match_type": args.ngram_match_type}
        if args.disable_by_batch_size is not None:
            shape["speculative_disable_by_batch_size"] = args.disable_by_batch_size
        setups.append((algo, algo, shape))
        if algo in ("EAGLE", "EAGLE3") and args.token_map:
            setups.append((f"{algo}+map", algo,
                           {**shape, "speculative_token_map": args.token_map}))
    for name, algo, shape in setups:
        engines[name] = LLM(model_path=args.model, speculative_algorithm=algo, **common,
                            **shape)
    tok = engines["plain"].tokenizer
    rows = []
    for wl in args.workloads:
        for bs in args.batch_sizes:
            prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
                       for m in workload(wl, bs)]
            prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
            got: dict[str, list[dict]] = {name: [] for name in engines}
            for rep in range(args.warmup_reps + args.reps):
                for name, llm in engines.items():  # interleaved: drift hits all alike
                    llm.engine.scheduler.kv.flush()
                    side = spec_side(llm.engine.scheduler)
                    if side is not None:  # no answer is known from an earlier repetition
                        side.reset_cache()
                    res = _run_batch(llm, prompts, args.output_len)
                    if rep >= args.warmup_reps:
                        got[name].append(res)
            base = got["plain"]
            for name, res in got.items():
                row = {"workload": wl, "batch": bs, "setup": name,
                       "tok_s": statistics.median(r["tok_s"] for r in res),
                       "tpot_p50_ms": statistics.median(r["tpot_p50_ms"] for r in res),
                       "accept_length": res[-1]["accept_length"],
                       "same_output": all(r["outputs"] == b["outputs"]
                                          for r, b in zip(res, base))}
                if name == "plain":
                    plain = row
                else:
                    row["tpot_ratio"] = plain["tpot_p50_ms"] / row["tpot_p50_ms"]
                    row["throughput_ratio"] = row["tok_s"] / plain["tok_s"]
                rows.append(row)
                print(f"{wl:6s} batch {bs:3d} {name:6s} {row['tok_s']:8.1f} tok/s  TPOT p50 "
                      f"{row['tpot_p50_ms']:6.1f} ms"
                      + (f"  accept {row['accept_length']:.2f}  TPOT x{row['tpot_ratio']:.2f}"
                         f"  tok/s x{row['throughput_ratio']:.2f}"
                         f"{'' if row['same_output'] else '  OUTPUT DIFFERS'}"
                         if name != "plain" else ""), flush=True)
    gates = {name: spec_side(llm.engine.scheduler).gate.state()
             for name, llm in engines.items() if spec_side(llm.engine.scheduler)}
    result = {"model": args.model, "dtype": args.dtype, "output_len": args.output_len,
              "reps": args.reps, "warmup_reps": args.warmup_reps, "box_load": load,
              "num_draft_tokens": args.num_draft_tokens,
              "draft": {"model": args.draft_model or args.model,
                        "quantization": args.draft_quantization, "steps": args.draft_steps},
              "rows": rows, "gates": gates}
    print("speculation gate (per batch-size range):", json.dumps(gates))
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    for llm in engines.values():
        llm.shutdown()
    return result
