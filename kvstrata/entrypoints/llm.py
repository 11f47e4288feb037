"""Offline engine, shaped like SGLang's `sgl.Engine`: the same engine core as the server,
in-process, without HTTP or ZMQ.

    from kvstrata import LLM, SamplingParams
    llm = LLM(model_path="smollm2-135m", page_size=16)
    out = llm.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
"""
from __future__ import annotations

import itertools
from typing import Any

from kvstrata.config.server_args import ServerArgs
from kvstrata.engine.request import EngineRequest
from kvstrata.entrypoints.engine_factory import build_engine, server_info_dict, start_up_info
from kvstrata.protocol import FinishReason, SamplingParams
from kvstrata.protocol.grammar import check_grammar
from kvstrata.protocol.sampling_params import split_top_logprobs


def finish_reason_dict(reason: FinishReason | None) -> dict | None:
    if reason is None:
        return None
    d: dict[str, Any] = {"type": reason.type, "matched": reason.matched}
    if reason.message is not None:
        d["message"] = reason.message
    return d


def output_text(tokenizer: Any, output_ids: list[int], reason: FinishReason | None,
                skip_special_tokens: bool, no_stop_trim: bool = False,
                stops: list[str] | None = None) -> str:
    """Detokenised output; a matched stop string (one of `stops`) and anything after it is
    cut (OpenAI), unless no_stop_trim (SGLang) keeps them. A matched stop_regex is kept (as
    SGLang keeps it)."""
    if tokenizer is None:
        return ""
    if not no_stop_trim and reason is not None and reason.by_token:
        output_ids = output_ids[:-1]  # the matched stop token is not text (SGLang)
    text = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    if no_stop_trim:
        return text
    if reason is not None and reason.type == "stop" and isinstance(reason.matched, str) \
            and (stops is None or reason.matched in stops):
        cut = text.find(reason.matched)
        if cut >= 0:
            text = text[:cut]
    return text


def refuse_pd_mode(args: ServerArgs) -> None:
    """A prefill or decode role only makes sense as a server: its requests come from a PD
    router with bootstrap fields, and its KV goes to / comes from another server."""
    if args.disaggregation_mode != "null":
        raise ValueError(f"--disaggregation-mode {args.disaggregation_mode} needs the server: "
                         f"run `kvstrata serve --disaggregation-mode "
                         f"{args.disaggregation_mode} ...` behind a PD router "
                         f"(docs/disaggregation.md); the offline LLM is co-located only")


class LLM:
    def __init__(self, model_path: str = "smollm2-135m", **server_args: Any):
        self.server_args = ServerArgs(model_path=model_path, **server_args)
        refuse_pd_mode(self.server_args)
        self.engine, self.tokenizer = build_engine(self.server_args)
        self._ids = itertools.count()

    # ------------------------------------------------------------------ generate
    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: SamplingParams | dict | list | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 return_logprob: bool = False) -> dict | list[dict]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("prompt text needs a tokenizer; pass input_ids with "
                                 "skip_tokenizer_init=True")
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            ids_list = [self.tokenizer(t)["input_ids"] for t in texts]
        else:
            single = bool(input_ids) and isinstance(input_ids[0], int) or input_ids == []
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]
        params = self._params_list(sampling_params, len(ids_list))
        if any(p.grammar_field for p in params) and (
                self.server_args.grammar_backend == "none" or self.tokenizer is None):
            raise ValueError("json_schema / regex / ebnf need the grammar backend and the "
                             "tokenizer (not grammar_backend='none' or skip_tokenizer_init)")
        for p in params:  # whether each grammar compiles (SamplingParams checked its limits)
            check_grammar(p)
        rids = [f"offline-{next(self._ids)}" for _ in ids_list]
        for rid, ids, sp in zip(rids, ids_list, params):
            self.engine.add_request(EngineRequest(rid, ids, sp, return_prompt_logprobs=return_logprob))
        results = self._run(rids)
        outs = [self._to_dict(rid, results[rid], sp) for rid, sp in zip(rids, params)]
        return outs[0] if single else outs

    @staticmethod
    def _params_list(sampling_params, n: int) -> list[SamplingParams]:
        items = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(items) != n:
            raise ValueError(f"sampling_params has {len(items)} entries for {n} prompts")
        return [p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p) for p in items]

    def _run(self, rids: list[str]) -> dict[str, dict]:
        acc = {rid: {"ids": [], "logprobs": [], "final": None, "prompt_logprobs": None}
               for rid in rids}
        pending = set(rids)
        while pending:
            for out in self.engine.step():
                a = acc.get(out.rid)
                if a is None:
                    continue
                a["ids"].extend(out.new_token_ids)
                if out.new_logprobs is not None:
                    a["logprobs"].extend(
                        (lp, tid, [(t.token_id, t.logprob) for t in top])
                        for lp, tid, top in zip(out.new_logprobs, out.new_token_ids,
                                                out.new_top_logprobs or []))
                if out.prompt_logprobs is not None:
                    a["prompt_logprobs"] = out.prompt_logprobs
                if out.finished:
                    a["final"] = out
                    pending.discard(out.rid)
        return acc

    def _to_dict(self, rid: str, acc: dict, sp: SamplingParams) -> dict:
        final = acc["final"]
        meta = {
            "id": rid,
            "finish_reason": finish_reason_dict(final.finish_reason),
            "prompt_tokens": final.prompt_tokens,
            "completion_tokens": final.completion_tokens,
            "cached_tokens": final.cached_tokens,
        }
        if final.spec is not None:
            meta.update(final.spec.meta_info(final.completion_tokens))
        if sp.logprobs is not None:
            meta["output_token_logprobs"] = [(lp, tid) for lp, tid, _ in acc["logprobs"]]
            parts = [split_top_logprobs(top, sp) for _, _, top in acc["logprobs"]]
            meta["output_top_logprobs"] = [top for top, _ in parts]
            if sp.token_ids_logprob:
                meta["output_token_ids_logprobs"] = [asked for _, asked in parts]
        if acc["prompt_logprobs"] is not None:
            meta["input_token_logprobs"] = acc["prompt_logprobs"]
        return {
            "text": output_text(self.tokenizer, acc["ids"], final.finish_reason,
                                sp.skip_special_tokens, sp.no_stop_trim, sp.stop),
            "output_ids": acc["ids"],
            "meta_info": meta,
        }

    # ------------------------------------------------------------------ admin
    def get_load(self) -> dict:
        return self.engine.get_load()

    def server_info(self) -> dict:
        """What `/server_info` returns for a server with these args: the resolved args, the
        KV plan and every start-up resolution."""
        return server_info_dict(self.server_args, start_up_info(self.engine))

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
