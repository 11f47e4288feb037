"""Step 7: speculative decoding (`--speculative-*`, SGLang's names and defaults).

What SGLang derives, with a recorded reason each:
  - NEXTN is EAGLE with the checkpoint's own MTP layer as the draft;
  - the draft shape (num_steps, eagle_topk, num_draft_tokens) is auto per algorithm when
    left unset: STANDALONE and EAGLE/NEXTN 3 / 1 / 4 (SGLang's default for models other
    than Llama/Grok); NGRAM verifies `--speculative-ngram-max-match-window-size` tokens;
  - with topk 1 the draft is a chain, so num_draft_tokens = num_steps + 1.
What kvstrata builds today: chain drafts of NGRAM (the n-gram cache's most frequent
continuation), STANDALONE (a draft checkpoint with the target's vocabulary,
`--speculative-draft-model-path`, optionally `--speculative-draft-model-quantization
w8a8_int8`), EAGLE and EAGLE3 (an EAGLE-2 / EAGLE-3 head, `--speculative-draft-model-path`),
chains and trees (topk > 1), and NEXTN (EAGLE with the checkpoint's own MTP layer, DeepSeek
models, Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, chains; the draft path defaults to the model's;
at --tp-size > 1 on Qwen3-Next and Qwen3.5 only, each rank running its share of the MTP
layer: refused here for a model without recurrent state, by rules/recurrent.py for the
other hybrids). NGRAM
builds SGLang's BFS and PROB trees; its breadth left unset resolves to 1 (a chain; SGLang's
default is 10) and says why.
"""
from __future__ import annotations

import dataclasses

from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs, apply, change
from kvstrata.config.server_args import QUANTIZATION_BUILT, ServerArgs, flag
from kvstrata.platform import Platform
from kvstrata.protocol.disagg import SPEC_TOPK_LIMIT

# Auto draft shape (num_steps, topk, num_draft_tokens) per algorithm (SGLang's docs).
AUTO_SHAPE = {"EAGLE": (3, 1, 4), "EAGLE3": (3, 1, 4), "STANDALONE": (3, 1, 4),
              "NEXTN": (3, 1, 4)}  # NEXTN: SGLang's DeepSeek MTP default
TREE_DRAFTS_REASON = ("kvstrata's default is a chain: a full tree per request in its first "
                      "steps cost ~7% throughput at batch 32 on CPU (docs/benchmarks.md); "
                      "a breadth above 1 drafts SGLang's BFS tree")
BUILT_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN")
# What a draft model may be quantized to: the built --quantization methods.
DRAFT_QUANTIZATIONS = QUANTIZATION_BUILT


def speculative(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                env: dict) -> list[Resolution]:
    algo = args.speculative_algorithm
    if algo is None:
        stray = [flag(f.name) for f in dataclasses.fields(ServerArgs)
                 if f.name.startswith("speculative_") and getattr(args, f.name) != f.default]
        if stray:  # accepted but ignored would hide a typo'd or forgotten algorithm
            raise ValueError(f"{', '.join(stray)} needs --speculative-algorithm")
        return []
    if algo == "NGRAM":
        model_flags = [flag(n) for n in ("speculative_draft_model_path",
                                         "speculative_draft_model_quantization")
                       if getattr(args, n) is not None]
        if model_flags:
            raise ValueError(f"{', '.join(model_flags)}: NGRAM has no draft model (it drafts "
                             f"from its n-gram cache)")
    if algo in ("STANDALONE", "EAGLE", "EAGLE3") and args.speculative_draft_model_path is None:
        what = "the draft checkpoint" if algo == "STANDALONE" else "the EAGLE head checkpoint"
        raise ValueError(f"--speculative-algorithm {algo} needs "
                         f"--speculative-draft-model-path ({what})")
    if algo == "NEXTN" and args.tp_size > 1 and not (model_info is not None
                                                      and model_info.has_recurrent_state):
        # (the hybrids' refusals by architecture: rules/recurrent.py, step 4c)
        raise ValueError(f"--speculative-algorithm NEXTN with --tp-size {args.tp_size} on "
                         f"{(model_info and model_info.architecture) or 'this model'}: the "
                         f"MTP layer is split across ranks for Qwen3-Next and Qwen3.5 only "
                         f"(NGRAM, STANDALONE and EAGLE run under TP)")
    out: list[Resolution] = []
    shape_of = algo
    if algo == "NEXTN":
        out += change(args, "speculative_algorithm", "EAGLE", "spec.nextn",
                      "NEXTN is EAGLE with the checkpoint's own MTP layer as the draft")
        if args.speculative_draft_model_path is None:
            out += change(args, "speculative_draft_model_path", args.model_path,
                          "spec.nextn_draft", "NEXTN reads the MTP layer from the model's "
                          "own checkpoint")
        algo = "EAGLE"
    if algo == "NGRAM":
        out += _ngram(args)
    else:
        out += _draft_model_shape(args, shape_of)
    args = apply(args, out)
    steps, topk, tokens = (args.speculative_num_steps, args.speculative_eagle_topk,
                           args.speculative_num_draft_tokens)
    if algo != "NGRAM" and topk > 1 and tokens - 1 > topk + (steps - 1) * topk * topk:
        raise ValueError(f"--speculative-num-draft-tokens {tokens}: a tree of topk {topk} "
                         f"over {steps} steps has only {topk + (steps - 1) * topk * topk} "
                         f"candidates for its {tokens - 1} drafts")
    if (algo in ("EAGLE", "EAGLE3") and args.disaggregation_mode != "null"
            and topk > SPEC_TOPK_LIMIT):
        raise ValueError(f"--speculative-eagle-topk {topk}: under PD the draft's top-k travels "
                         f"in the transfer metadata, at most {SPEC_TOPK_LIMIT} entries "
                         f"(SGLang's limit)")
    if topk == 1 and tokens != steps + 1:
        out += change(args, "speculative_num_draft_tokens", steps + 1, "spec.chain",
                      f"topk 1 drafts a chain: num_draft_tokens = num_steps + 1 = {steps + 1}")
    return out


def _ngram(args: ResolvedArgs) -> list[Resolution]:
    lo, hi = (args.speculative_ngram_min_match_window_size,
              args.speculative_ngram_max_match_window_size)
    if lo > hi:
        raise ValueError(f"--speculative-ngram-min-match-window-size {lo} must be <= "
                         f"--speculative-ngram-max-match-window-size {hi}")
    out: list[Resolution] = []
    breadth = args.speculative_ngram_max_bfs_breadth
    if breadth is None:
        breadth = 1
        out += change(args, "speculative_ngram_max_bfs_breadth", 1, "spec.ngram_breadth",
                      f"SGLang's default is 10 (a tree); {TREE_DRAFTS_REASON}")
    if args.speculative_ngram_min_bfs_breadth > breadth:
        raise ValueError(f"--speculative-ngram-min-bfs-breadth "
                         f"{args.speculative_ngram_min_bfs_breadth} must be <= "
                         f"--speculative-ngram-max-bfs-breadth {breadth}")
    tokens = args.speculative_num_draft_tokens
    if tokens is None:
        tokens = max(hi, 2)
        out += change(args, "speculative_num_draft_tokens", tokens, "spec.ngram_tokens",
                      f"NGRAM verifies --speculative-ngram-max-match-window-size ({hi}) "
                      f"tokens per step by default")
    if args.speculative_eagle_topk is None:
        out += change(args, "speculative_eagle_topk", breadth, "spec.ngram_topk",
                      "NGRAM's topk is its BFS breadth")
    if args.speculative_num_steps is None:
        out += change(args, "speculative_num_steps", tokens - 1, "spec.ngram_steps",
                      "an NGRAM chain drafts num_draft_tokens - 1 tokens")
    return out


def _draft_model_shape(args: ResolvedArgs, algo: str) -> list[Resolution]:
    steps, topk, tokens = AUTO_SHAPE.get(algo, AUTO_SHAPE["EAGLE"])
    out: list[Resolution] = []
    given = (args.speculative_num_steps, args.speculative_eagle_topk,
             args.speculative_num_draft_tokens)
    for name, auto, value in zip(("speculative_num_steps", "speculative_eagle_topk",
                                  "speculative_num_draft_tokens"), (steps, topk, tokens), given):
        if value is None:
            out += change(args, name, auto, "spec.auto_shape",
                          f"{algo} auto draft shape: steps {steps}, topk {topk}, "
                          f"draft tokens {tokens}")
    return out


def unbuilt(args) -> list[str]:
    """The speculative choices kvstrata cannot serve yet (resolve.py refuses them by name)."""
    algo = args.speculative_algorithm
    if algo is None:
        return []
    missing = []
    if algo not in BUILT_ALGORITHMS:
        missing.append(f"--speculative-algorithm {algo}")
    quant = args.speculative_draft_model_quantization
    if quant not in (None, "unquant") + DRAFT_QUANTIZATIONS:
        missing.append(f"--speculative-draft-model-quantization {quant}")
    elif quant not in (None, "unquant") and algo in ("EAGLE", "EAGLE3"):
        missing.append(f"--speculative-draft-model-quantization {quant} with {algo} (the "
                       f"head is one layer; it runs in the target's dtype)")
    if args.speculative_token_map is not None and algo != "EAGLE":
        missing.append(f"--speculative-token-map with {algo} (FR-Spec is built for EAGLE "
                       f"heads)")
    return missing
