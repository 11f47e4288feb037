"""Cross-check of our GGUF writers and loader against a real llama.cpp.

The GGUF tests write tiny files the way we read convert_hf_to_gguf.py (tests/helpers/
*gguf*.py) and check kvstrata against transformers on them; nothing there shows that
llama.cpp reads those files the same way. Per family this script writes the file with the
tests' own writer, runs llama.cpp's llama-server greedy on token ids (/completion with
"prompt": [ids], temperature 0, n_probs), runs kvstrata's offline engine (float32) and
transformers (the model's reference) on the same ids, and reports: does llama.cpp load the
file, for how many tokens its greedy continuation equals kvstrata's (and kvstrata's equals
transformers'), the largest difference of the chosen token's logprob between llama.cpp and
transformers (both over the whole vocabulary) over the positions where llama.cpp and kvstrata
chose the same token, and, at a first disagreement,
transformers' margin between its top two logits there (a near-tie explains a flip; a wide
margin means one side computes another model).

  KVSTRATA_LLAMA_CPP_BIN=/path/to/llama.cpp/bin .venv/bin/python \\
      benchmarks/crosscheck_llama_cpp.py [--families llama qwen3 ...] [--f32]

--f32 writes every matrix as F32 where the writer takes a type (llama / qwen3, the families
of tests/helpers/family_gguf.py, the hybrids; gpt-oss's experts F16, Gemma's files are
float anyway) so that quantized-activation rounding in llama.cpp
(it quantizes activations to Q8 for Q4/Q8 weights) cannot flip a near-tie. Needs the
binaries (llama-server and its .so files in one folder; `-nr`: ggml's AMX repack traps on
some VMs). Nothing in `make test` runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

DECODERS = ("llama", "qwen3")
FAMILY_GGUF = ("qwen2", "qwen2_moe", "qwen3_moe", "mixtral", "phi3", "olmo2", "glm4",
               "smollm3", "glm4_moe", "deepseek_v3", "deepseek_v2_lite")
GEMMAS = ("gemma2", "gemma3")
HYBRIDS = ("mamba2", "nemotron_h", "granite", "qwen3_5", "qwen3_next", "falcon_h1",
           "qwen3_5_moe", "nemotron_h_moe")
ALL = (*DECODERS, *FAMILY_GGUF, *GEMMAS, "gpt_oss", *HYBRIDS)
PROMPT_LENS = (5, 21)
PROMPT_VOCAB = 150  # below every writer's vocabulary (the hybrids' is 160)


# ------------------------------------------------------------------ the files
def write_file(family: str, root: str, f32: bool):
    """(GGUF path, transformers' float32 model holding the file's values, LLM extra args)."""
    if family in DECODERS:
        from helpers import decoder_gguf

        types = None
        if f32:
            types = {k: ({p: "F32" for p in v} if isinstance(v, dict) else "F32")
                     for k, v in decoder_gguf.TYPES.items()}
        path = os.path.join(root, f"{family}.gguf")
        config, reference = decoder_gguf.write_decoder_gguf(family, path, types=types)
        return path, decoder_gguf.transformers_model(config, reference), {}
    if family in FAMILY_GGUF:
        from helpers import family_gguf

        saved, nextn = dict(family_gguf.TYPES), dict(family_gguf.NEXTN)
        if f32:  # the writer reads its module's type map at write time
            family_gguf.TYPES.update({k: "F32" for k in saved})
        # the tests' GLM-4.5 NextN block is two tensors (nothing of ours reads it); llama.cpp
        # wants the converter's whole layer there, so the cross-check writes none
        family_gguf.NEXTN.update({k: 0 for k in nextn})
        try:
            path = os.path.join(root, f"{family}.gguf")
            return path, family_gguf.write_family_gguf(family, path), {}
        finally:
            family_gguf.TYPES.update(saved)
            family_gguf.NEXTN.update(nextn)
    if family in GEMMAS:  # the writer's default: every weight float32
        from helpers.gemma_ckpt import build_gemma_checkpoint, hf_gemma
        from helpers.gemma_gguf import gguf_compatible_config, write_gemma_gguf

        hf = build_gemma_checkpoint(family, os.path.join(root, family),
                                    config=gguf_compatible_config(family))
        return write_gemma_gguf(hf, os.path.join(root, f"{family}.gguf")), hf_gemma(hf), {}
    ref = os.path.join(root, f"{family}-ref")
    if family == "gpt_oss":  # MXFP4 experts, as the converter writes them
        from helpers.gpt_oss import build_checkpoint, load_reference
        from helpers.gpt_oss_gguf import gguf_compatible_overrides, write_gpt_oss_gguf

        hf = build_checkpoint(os.path.join(root, family), seed=5, **gguf_compatible_overrides)
        path = write_gpt_oss_gguf(hf, os.path.join(root, "gpt_oss.gguf"), ref,
                                  expert_type="F16" if f32 else "MXFP4")
        return path, load_reference(ref), {}
    from helpers import hybrid_gguf

    saved = hybrid_gguf.QUANT
    hybrid_gguf.QUANT = "F32" if f32 else saved  # the writers' one matrix type
    try:
        return _write_hybrid(family, root, ref)
    finally:
        hybrid_gguf.QUANT = saved


def _write_hybrid(family: str, root: str, ref: str):
    """As tests/correctness/test_hybrid_gguf.py builds them (the converter's limits)."""
    from helpers import hybrid_ckpt as hc
    from helpers.hybrid_gguf import write_hybrid_gguf
    from helpers.hybrid_gguf_extra import write_hybrid_gguf_extra

    hf_dir, path = os.path.join(root, family), os.path.join(root, f"{family}.gguf")
    if family == "nemotron_h_moe":
        hf = hc.build_nemotron_h_moe_checkpoint(hf_dir, n_group=1, topk_group=1)
        write_hybrid_gguf_extra(family, hf, path, ref)
    elif family == "falcon_h1":
        hf = hc.build_falcon_h1_checkpoint(hf_dir, mamba_proj_bias=False,
                                           projectors_bias=False, mamba_norm_before_gate=False)
        write_hybrid_gguf_extra(family, hf, path, ref)
    elif family == "qwen3_5_moe":
        write_hybrid_gguf(family, hc.build_qwen3_5_moe_checkpoint(hf_dir), path, ref)
    else:
        extra = {"decoder_sparse_step": 1} if family == "qwen3_next" else {}
        if family in ("qwen3_5", "qwen3_next"):  # llama.cpp takes head_v_dim = ssm.state_size
            extra["linear_value_head_dim"] = hc.tiny_hybrid_config(family).linear_key_head_dim
        write_hybrid_gguf(family, hc.build_hybrid_checkpoint(family, hf_dir, **extra), path,
                          ref)
    return path, hc.hf_hybrid(ref), {"max_mamba_cache_size": 24}


# ------------------------------------------------------------------ the three runs
def transformers_greedy(model, prompts, new: int):
    """Per prompt: (tokens, per-step float32 logits with end-of-sequence at -inf, the chosen
    tokens' logprobs over the whole vocabulary): a whole forward per step (no cache to get
    wrong); end-of-sequence never chosen, as llama.cpp's ignore_eos (a -inf bias) and
    kvstrata's min_new_tokens do."""
    import torch

    eos = model.config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    out = []
    for prompt in prompts:
        ids, tokens, steps, logprobs = list(prompt), [], [], []
        for _ in range(new):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            masked = logits.clone()
            masked[eos] = float("-inf")
            steps.append(masked)
            tokens.append(int(masked.argmax()))
            ids.append(tokens[-1])
            logprobs.append(float(torch.log_softmax(logits, -1)[tokens[-1]]))
        out.append((tokens, steps, logprobs))
    return out


def kvstrata_greedy(path: str, prompts, new: int, extra: dict):
    """Per prompt: (tokens, the chosen tokens' logprobs)."""
    from kvstrata import LLM

    params = {"max_new_tokens": new, "min_new_tokens": new, "temperature": 0,
              "ignore_eos": True, "logprobs": 0}
    with LLM(model_path=path, skip_tokenizer_init=True, dtype="float32", page_size=16,
             max_total_tokens=1024, **extra) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params)
    return [(o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def llama_cpp_greedy(bin_dir: str, path: str, prompts, new: int, log_path: str):
    """Per prompt: (tokens, chosen logprobs, prompt tokens llama.cpp evaluated); or the
    error line that stopped llama-server."""
    port = _free_port()
    env = {**os.environ, "LD_LIBRARY_PATH": bin_dir}
    cmd = [os.path.join(bin_dir, "llama-server"), "-m", path, "--port", str(port), "-c", "512",
           "-np", "1", "-t", "2", "-nr", "--no-warmup"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            if server.poll() is not None:
                return _load_error(log_path)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                return "llama-server did not come up in 120 s"
            time.sleep(0.3)
        out = []
        for prompt in prompts:
            body = {"prompt": prompt, "n_predict": new, "temperature": 0, "n_probs": 1,
                    "return_tokens": True, "ignore_eos": True, "cache_prompt": False}
            resp = _post(port, body)
            probs = resp.get("completion_probabilities", [])
            out.append((resp["tokens"], [p["logprob"] for p in probs],
                        resp.get("tokens_evaluated")))
        return out
    finally:
        server.terminate()
        server.wait(timeout=30)


def _load_error(log_path: str) -> str:
    lines = open(log_path, errors="replace").read().splitlines()
    errors = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
    return (errors or lines or ["llama-server exited"])[0].strip()[:300]


# ------------------------------------------------------------------ comparison
def _common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def compare(family: str, cpp, ours, ref, prompts, new: int) -> dict:
    row = {"family": family, "loads": not isinstance(cpp, str)}
    row["ours_vs_hf"] = sum(_common_prefix(o[0], r[0]) for o, r in zip(ours, ref))
    row["total"] = new * len(prompts)
    if isinstance(cpp, str):
        row["error"] = cpp
        return row
    row["cpp_vs_ours"] = sum(_common_prefix(c[0], o[0]) for c, o in zip(cpp, ours))
    row["cpp_vs_hf"] = sum(_common_prefix(c[0], r[0]) for c, r in zip(cpp, ref))
    diffs, margins = [], []
    for (c_tok, c_lp, evaluated), (o_tok, _), (r_tok, r_logits, r_lp), prompt in zip(
            cpp, ours, ref, prompts):
        if evaluated is not None and evaluated != len(prompt):
            row.setdefault("notes", []).append(f"llama.cpp evaluated {evaluated} prompt "
                                               f"tokens for {len(prompt)}")
        same = _common_prefix(c_tok, o_tok)
        # against transformers' logprobs: kvstrata's come after min_new_tokens masked the
        # end-of-sequence token, llama.cpp's (and these) over the whole vocabulary
        diffs += [abs(a - b) for a, b in zip(c_lp[:same], r_lp[:same])]
        if same < len(c_tok) and same < len(r_logits):  # the reference's margin there
            top = r_logits[same].topk(2).values
            margins.append(round(float(top[0] - top[1]), 4))
    row["max_logprob_diff"] = max(diffs) if diffs else None
    row["margin_at_flip"] = margins
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| family | llama.cpp loads | llama.cpp = kvstrata | llama.cpp = transformers "
             "| kvstrata = transformers | max logprob diff llama.cpp vs HF | HF top-2 margin at a "
             "flip |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        total = r["total"]
        if not r["loads"]:
            lines.append(f"| {r['family']} | no: `{r['error']}` | - | - | "
                         f"{r['ours_vs_hf']}/{total} | - | - |")
            continue
        diff = r["max_logprob_diff"]
        lines.append(f"| {r['family']} | yes | {r['cpp_vs_ours']}/{total} | "
                     f"{r['cpp_vs_hf']}/{total} | {r['ours_vs_hf']}/{total} | "
                     f"{'-' if diff is None else f'{diff:.2e}'} | "
                     f"{', '.join(map(str, r['margin_at_flip'])) or '-'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=list(ALL), choices=ALL)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--f32", action="store_true")
    parser.add_argument("--keep", help="folder to keep the files and server logs in")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    bin_dir = os.environ.get("KVSTRATA_LLAMA_CPP_BIN")
    if not bin_dir or not os.path.exists(os.path.join(bin_dir, "llama-server")):
        sys.exit("set KVSTRATA_LLAMA_CPP_BIN to the folder holding llama-server")
    root = args.keep or tempfile.mkdtemp(prefix="crosscheck-llama-cpp-")
    os.makedirs(root, exist_ok=True)
    os.environ["XDG_CACHE_HOME"] = os.path.join(root, "cache")  # model_source's cache
    rng = random.Random(9)
    prompts = [[rng.randrange(4, PROMPT_VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    rows = []
    for family in args.families:
        try:
            path, hf, extra = write_file(family, root, args.f32)
            ref = transformers_greedy(hf, prompts, args.new_tokens)
            ours = kvstrata_greedy(path, prompts, args.new_tokens, extra)
        except Exception as exc:  # a writer / kvstrata failure is a row, not the end
            rows.append({"family": family, "loads": False, "total": 0, "ours_vs_hf": 0,
                         "error": f"ours: {type(exc).__name__}: {exc}"[:300]})
            print(json.dumps(rows[-1]), flush=True)
            continue
        cpp = llama_cpp_greedy(bin_dir, path, prompts, args.new_tokens,
                               os.path.join(root, f"{family}.server.log"))
        rows.append(compare(family, cpp, ours, ref, prompts, args.new_tokens))
        print(json.dumps(rows[-1]), flush=True)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
