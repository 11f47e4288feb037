"""Decode throughput of an SSM hybrid served by kvstrata against HF transformers on the same
weights, in the same process and the same minutes (issue 62): batch 1 and 8 by default.

The models (random weights, built here), hidden 256, vocab 1024, 8 layers, fp32 -- small enough
for 2 CPU cores, big enough that the layers, not Python, are most of a step:
  --model qwen3_5     (benchmarks/bench_hybrid_context.py's) Qwen3-Next's layer pattern as a
                      Qwen3.5 text config: three linear_attention layers (Gated DeltaNet, 4 key
                      / 8 value heads of 64, conv kernel 4) to one full_attention (8 query / 2
                      KV heads of 64, output-gated, partial rope), SwiGLU MLPs.
  --model nemotron_h  Nemotron-H blocks M-M*M-M-: four Mamba2 (8 heads of 64, d_state 64, 2
                      groups), one attention, three relu^2 MLPs.
  --model falcon_h1   Falcon-H1, 8 layers each with attention (8 query / 2 KV heads of 64,
                      rope) and Mamba2 (8 heads of 64, d_state 64, 2 groups, no mixer norm as
                      the released small models) side by side, SwiGLU MLPs.

Each round draws B prompts of --prompt tokens (equal lengths: transformers needs no padding)
and runs both arms on them, alternating which goes first:
  transformers  model(prompt) once, then --new steps of model(last token, cache=cache)
                under inference_mode, greedy argmax: the lean loop,
                without generate()'s processors (its recurrent layers run transformers' torch
                fallbacks: no flash-linear-attention / causal-conv1d on a CPU).
  kvstrata      LLM(...).engine: the B requests added at once, stepped to the end (scheduler,
                KV and state pools, sampler included); the clock starts once every request
                has its first token.
Decode throughput = B x (decode steps) / decode seconds; the figure is kvstrata / transformers,
each round's ratio of its two adjacent arms, median over --rounds rounds. The arms' greedy
tokens are compared as a check that both did the same work (fp32: they should agree; random
weights can leave near-ties). At these widths a step is mostly the linear layers, the same
matmuls in both arms, so the ratio understates the gap in the rest (recurrent step,
attention, overhead).
On a busy box pass --threads 1 (at load 9 on 2 vCPUs, two threads made both arms several
times slower and the rounds erratic).

  .venv/bin/python benchmarks/bench_hybrid_decode.py --threads 1 --rounds 5 \
      --out benchmarks/results/hybrid_decode.json
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_hybrid_context import DIMS, build, parse_and_announce  # noqa: E402

from kvstrata.bench.report import write_json  # noqa: E402


# Nemotron-H at the same widths: 8 blocks, four Mamba2 (8 heads of 64, d_state 64, 2 groups),
# one attention (8 query / 2 KV heads of 64, no rope), three relu^2 MLPs
NEMOTRON_H = dict(hybrid_override_pattern="M-M*M-M-", mamba_num_heads=8, mamba_head_dim=64,
                  ssm_state_size=64, n_groups=2, chunk_size=64, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64)
# Falcon-H1 at the same widths: every one of the 8 layers attention and Mamba2
FALCON_H1 = dict(mamba_d_ssm=512, mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64,
                 mamba_n_groups=2, mamba_chunk_size=64, mamba_rms_norm=False)
MODELS = {"nemotron_h": NEMOTRON_H, "falcon_h1": FALCON_H1}


def build_model(model: str, root: str, positions: int) -> str:
    if model == "qwen3_5":
        return build("hybrid", root, positions)
    import transformers as tf
    from transformers import AutoModelForCausalLM

    fields = MODELS[model]
    dims = {k: v for k, v in DIMS.items() if k not in fields and k != "num_hidden_layers"}
    config_class = tf.NemotronHConfig if model == "nemotron_h" else tf.FalconH1Config
    cfg = config_class(**dims, **fields, num_hidden_layers=8, max_position_embeddings=positions)
    torch.manual_seed(3)
    path = os.path.join(root, model)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def hf_decode(model, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """(decode seconds for `new` steps after the prefill, the greedy tokens incl. the first)."""
    with torch.inference_mode():
        out = model(torch.tensor(prompts), use_cache=True)
        cache, nxt = out.cache, out.logits[:, -1].argmax(-1)
        tokens = [nxt]
        t0 = time.perf_counter()
        for _ in range(new):
            out = model(nxt[:, None], cache=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1)
            tokens.append(nxt)
        seconds = time.perf_counter() - t0
    return seconds, torch.stack(tokens, 1).tolist()


def kvstrata_decode(llm, prompts: list[list[int]], new: int, tag: str
                    ) -> tuple[float, list[list[int]]]:
    """The same for the engine: B requests added at once; the clock starts at the end of the
    step in which the last of them got its first token, and stops when all have `new` more."""
    from kvstrata import SamplingParams
    from kvstrata.engine.request import EngineRequest

    params = SamplingParams(max_new_tokens=new + 1, ignore_eos=True, temperature=0)
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts):
        llm.engine.add_request(EngineRequest(rid, list(ids), params))
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    t0 = None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            tokens[out.rid] += out.new_token_ids
        if t0 is None and all(tokens.values()):
            t0 = time.perf_counter()
            decoded_before = sum(len(t) for t in tokens.values())
    seconds = time.perf_counter() - t0
    # a request may have decoded in the step that prefilled the last one (chunked prefill):
    # those steps are outside the clock, so scale to the tokens decoded inside it
    inside = sum(len(t) for t in tokens.values()) - decoded_before
    return seconds * (len(prompts) * new) / max(inside, 1), [tokens[r] for r in rids]


def compare(path: str, a) -> dict:
    from transformers import AutoModelForCausalLM

    from kvstrata import LLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model_path=path, skip_tokenizer_init=True, dtype="float32",
              max_running_requests=max(a.batches), disable_radix_cache=True)
    rng = random.Random(5)
    results = {}
    for batch in a.batches:
        kv_s, hf_s, agree, total = [], [], 0, 0
        kvstrata_decode(llm, [[3 + i] * 8 for i in range(batch)], 2, f"warm{batch}")
        hf_decode(hf, [[3] * 8] * batch, 2)
        for r in range(a.rounds):
            prompts = [[rng.randrange(3, DIMS["vocab_size"]) for _ in range(a.prompt)]
                       for _ in range(batch)]
            arms = [("hf", lambda: hf_decode(hf, prompts, a.new)),
                    ("kv", lambda: kvstrata_decode(llm, prompts, a.new, f"b{batch}r{r}"))]
            got = {}
            for name, fn in (arms if r % 2 == 0 else arms[::-1]):
                got[name] = fn()
            hf_s.append(got["hf"][0])
            kv_s.append(got["kv"][0])
            for mine, theirs in zip(got["kv"][1], got["hf"][1]):
                agree += sum(x == y for x, y in zip(mine, theirs))
                total += len(theirs)
        hf_tps = batch * a.new / statistics.median(hf_s)
        kv_tps = batch * a.new / statistics.median(kv_s)
        # the ratio of each round's adjacent arms, then the median: a busy box's load drifts
        # between rounds more than within one
        ratios = [h / k for h, k in zip(hf_s, kv_s)]
        ratio = statistics.median(ratios)
        results[str(batch)] = {"transformers_tok_s": hf_tps, "kvstrata_tok_s": kv_tps,
                               "ratio": ratio, "round_ratios": ratios,
                               "tokens_agree": agree / total,
                               "hf_decode_s": hf_s, "kvstrata_decode_s": kv_s}
        print(f"batch {batch}: transformers {hf_tps:7.1f} tok/s  kvstrata {kv_tps:7.1f} tok/s"
              f" (medians); kvstrata / transformers {ratio:.2f}x (median of the rounds: "
              f"{', '.join(f'{r:.2f}' for r in ratios)}); greedy tokens agree "
              f"{agree / total:.1%}", flush=True)
    llm.check_integrity()
    llm.shutdown()
    return results


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["qwen3_5", "nemotron_h", "falcon_h1"],
                    default="qwen3_5", help="Gated DeltaNet (Qwen3.5) or Mamba2 (Nemotron-H, "
                                            "Falcon-H1) hybrid")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=32, help="timed decode steps")
    ap.add_argument("--rounds", type=int, default=3, help="median of the rounds")
    a, result = parse_and_announce(ap, argv)
    result.update(model=a.model, prompt=a.prompt, new=a.new, rounds=a.rounds)
    if a.model in MODELS:
        result[a.model] = MODELS[a.model]
    with tempfile.TemporaryDirectory() as root:
        path = build_model(a.model, root, a.prompt + a.new + 64)
        result["batches"] = compare(path, a)
    if a.out:
        write_json(a.out, result)
    return result


if __name__ == "__main__":
    main()
