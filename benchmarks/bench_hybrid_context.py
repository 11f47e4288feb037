"""A Gated DeltaNet hybrid vs a dense model of the same size on the CPU (issue 62): the decode
step time at growing contexts, and a multi-turn chat's TTFT with the snapshot prefix cache
against the same chat recomputed (--disable-radix-cache). Both models run in this process,
interleaved round by round, so the ratios come from the same minutes of the box.

Models (random weights, built here): the hybrid is Qwen3-Next's layer pattern (three
linear_attention layers to one full_attention, partial rope, output-gated attention, Gated
DeltaNet with twice as many value heads as key heads) as a Qwen3.5 text config -- Qwen3-Next
without its MoE, so that the dense baseline, a Qwen3 config of the same widths and layer
count, differs in the token mixer only. The dense model's step grows with the context on
every layer, the hybrid's on a quarter of them (its recurrent layers' state is fixed-size):
the slope ratio (dense / hybrid growth from the shortest to each longer context) is what
the issue asks for (about 4).

Decode: B requests whose rows list C positions (K/V and states left as allocated: timing does
not depend on the contents, and a 32k prefill per request would take minutes), one token a
step at position C (benchmarks/bench_decode_step.py's DecodeBatch). Chat: --conversations
chats of a --context-token context, then --turns user messages of --user tokens, each
answered with --answer tokens; TTFT of every turn after the first (turn 0 is cold in both
arms), p50, and the prompt tokens served from the cache (hits must happen).

  .venv/bin/python benchmarks/bench_hybrid_context.py --out benchmarks/results/hybrid_context.json
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_decode_step import PAGE, DecodeBatch, _timed  # noqa: E402
from bench_reuse import timed_request  # noqa: E402

from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402
from kvstrata.bench.report import write_json  # noqa: E402

DIMS = dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            initializer_range=0.05, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, tie_word_embeddings=False)
GDN = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
           linear_value_head_dim=64, linear_conv_kernel_dim=4)


def build(kind: str, root: str, max_positions: int) -> str:
    import transformers as tf
    from transformers import AutoModelForCausalLM

    if kind == "hybrid":
        cfg = tf.Qwen3_5TextConfig(**DIMS, **GDN, max_position_embeddings=max_positions,
                                   rope_parameters={"rope_type": "default",
                                                    "rope_theta": 10000000.0,
                                                    "partial_rotary_factor": 0.25})
        assert cfg.layer_types.count("full_attention") * 4 == DIMS["num_hidden_layers"]
    else:
        cfg = tf.Qwen3Config(**DIMS, max_position_embeddings=max_positions)
    torch.manual_seed(3)
    path = os.path.join(root, kind)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def decode_runner(path: str, batch: int, contexts: list[int]):
    """A ModelRunner with a hand-sized plan: every context's B rows of pages at once, and a
    state slot per row for the hybrid."""
    from kvstrata.config.kv_plan import KVPlan
    from kvstrata.runner.model_runner import ModelRunner

    runner = ModelRunner(path, dtype="float32", device="cpu")
    facts = runner.kv_facts()
    rows = batch * len(contexts) + 1
    pages = sum(batch * (c // PAGE + 1) for c in contexts) + 1
    slots = rows if facts.state_components else 0
    runner.allocate_kv(KVPlan(PAGE, pages, rows, max(contexts) + 1, facts.pool_kind,
                              facts.components, num_state_slots=slots,
                              state_components=facts.state_components))
    return runner, bool(slots)


def decode_steps(paths: dict, a) -> dict:
    """Median step ms per (model, context), the models alternating round by round."""
    setups = {}
    for kind, path in paths.items():
        runner, state = decode_runner(path, a.batch, a.contexts)
        batches, row, page = [], 1, 1
        for ctx in a.contexts:
            b = DecodeBatch(runner, a.batch, ctx, row, page, first_state_slot=row if state else 0)
            batches.append(b)
            row, page = row + a.batch, b.last_page + 1
        setups[kind] = (runner, batches)
    times = {(k, c): [] for k in paths for c in a.contexts}
    with torch.inference_mode():
        for _ in range(a.rounds):
            for kind, (_, batches) in setups.items():
                for ctx, b in zip(a.contexts, batches):
                    b.step()  # warm-up
                    times[(kind, ctx)].append(min(_timed(b.step) for _ in range(a.steps)))
    for runner, batches in setups.values():
        for b in batches:
            b.free()
        runner.shutdown()
    return {k: {str(c): statistics.median(times[(k, c)]) * 1e3 for c in a.contexts}
            for k in paths}


def chat(path: str, radix: bool, a) -> dict:
    from kvstrata import LLM, SamplingParams

    llm = LLM(model_path=path, skip_tokenizer_init=True, dtype="float32", page_size=a.page_size,
              max_total_tokens=a.chat_tokens, disable_radix_cache=not radix)
    rng = random.Random(1)
    tok = lambda n: [rng.randrange(3, DIMS["vocab_size"]) for _ in range(n)]  # noqa: E731
    params = SamplingParams(max_new_tokens=a.answer, ignore_eos=True, temperature=0)
    history = [tok(a.context) for _ in range(a.conversations)]
    ttft, prompt, cached = [], 0, 0
    timed_request(llm, "warm-up", tok(64), params)
    for turn in range(a.turns + 1):
        for c in range(a.conversations):
            if turn:
                history[c] += tok(a.user)
            first, out_ids, final = timed_request(llm, f"{c}-{turn}", history[c], params)
            assert first is not None, f"no token for {len(history[c])} tokens: {final}"
            history[c] += out_ids
            if turn:
                ttft.append(first)
                prompt += final.prompt_tokens
                cached += final.cached_tokens
    llm.check_integrity()
    llm.shutdown()
    return {"ttft_p50_ms": statistics.median(ttft) * 1e3, "prompt_tokens": prompt,
            "cached_tokens": cached, "hit_rate": cached / prompt}


def report_decode(steps: dict, a, result: dict) -> None:
    result["decode_ms"] = steps
    base = str(a.contexts[0])
    for ctx in a.contexts:
        d, h = steps["dense"][str(ctx)], steps["hybrid"][str(ctx)]
        line = (f"decode B={a.batch} ctx {ctx:6d}: dense {d:8.2f} ms  hybrid {h:8.2f} ms  "
                f"hybrid/dense {h / d:.2f}x")
        if str(ctx) != base:
            gd, gh = d - steps["dense"][base], h - steps["hybrid"][base]
            result.setdefault("growth_ratio", {})[str(ctx)] = gd / gh if gh > 0 else None
            line += (f"; growth from {base}: dense +{gd:.2f} ms, hybrid +{gh:.2f} ms"
                     + (f" ({gd / gh:.1f}x)" if gh > 0 else ""))
        print(line, flush=True)


def parse_and_announce(ap: argparse.ArgumentParser, argv) -> tuple[argparse.Namespace, dict]:
    """The hybrid benches' shared tail of argument parsing: --threads, --out, the quiet-box
    check; the parsed args and the result's common fields (box load, threads, model dims)."""
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    add_quiet_arg(ap)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    load = announce_load(a.require_quiet)
    return a, {"load": load, "threads": torch.get_num_threads(), "dims": DIMS, "gdn": GDN}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round (best of)")
    ap.add_argument("--rounds", type=int, default=3, help="median of the rounds")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024, help="each chat's first prompt")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--user", type=int, default=32)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=1, help="chat arms (1: no_buffer, "
                    "> 1: extra_buffer snapshots at page ends)")
    ap.add_argument("--chat-tokens", type=int, default=32768, help="--max-total-tokens of "
                    "the chat arms (the cache holds every chat)")
    ap.add_argument("--skip-chat", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    a, result = parse_and_announce(ap, argv)
    result.update(batch=a.batch, page_size=a.page_size)
    with tempfile.TemporaryDirectory() as root:
        chat_len = a.context + a.turns * (a.user + a.answer) + a.answer
        positions = max(max(a.contexts), chat_len) + 64
        paths = {k: build(k, root, positions) for k in ("dense", "hybrid")}
        if not a.skip_decode:
            report_decode(decode_steps(paths, a), a, result)
        if not a.skip_chat:
            result["chat"] = {}
            for kind in ("hybrid", "dense"):
                arms = {"cold": chat(paths[kind], False, a), "hit": chat(paths[kind], True, a)}
                arms["cold_over_hit"] = arms["cold"]["ttft_p50_ms"] / arms["hit"]["ttft_p50_ms"]
                result["chat"][kind] = arms
                print(f"chat {kind:6s} P={a.page_size}: TTFT p50 cold "
                      f"{arms['cold']['ttft_p50_ms']:.1f} ms, with the prefix cache "
                      f"{arms['hit']['ttft_p50_ms']:.1f} ms ({arms['cold_over_hit']:.1f}x); "
                      f"hit rate {arms['hit']['hit_rate']:.1%} of "
                      f"{arms['hit']['prompt_tokens']} prompt tokens", flush=True)
    if a.out:
        write_json(a.out, result)
    return result


if __name__ == "__main__":
    main()
