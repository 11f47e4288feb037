"""Start-up with a real (tiny) model: one resolution with the model's facts, one KVPlan that
the runner, the pools, the scheduler and the KV manager all share, and server_info showing
the resolved values."""
from __future__ import annotations

import pytest


def test_resolves_once_sizes_once_and_shares_one_plan(tiny_checkpoints, monkeypatch):
    from kvstrata import LLM
    from kvstrata.entrypoints import engine_factory

    resolve_calls, sizing_calls = [], []

    def counting(real, calls):
        def wrapper(*args, **kwargs):
            calls.append((args, kwargs))
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(engine_factory, "resolve", counting(engine_factory.resolve,
                                                            resolve_calls))
    monkeypatch.setattr(engine_factory, "size_kv_plan", counting(engine_factory.size_kv_plan,
                                                                 sizing_calls))
    llm = LLM(model_path=tiny_checkpoints["qwen3"], skip_tokenizer_init=True, page_size=4,
              max_total_tokens=1002, max_running_requests=8)
    try:
        assert len(resolve_calls) == 1 and len(sizing_calls) == 1
        assert resolve_calls[0][1]["model_info"] is not None  # with the model's facts
        engine = llm.engine
        plan = engine.kv_plan
        assert engine.runner.plan is plan and engine.scheduler.config.plan is plan
        assert engine.scheduler.kv.plan is plan and engine.runner.kv_pool.plan is plan
        assert (plan.page_size, plan.num_pages, plan.num_rows) == (4, 250, 8)
        # Bytes per token as sized == what the device pool really allocated.
        assert engine.runner.kv_pool.size_bytes == plan.device_pool_bytes
        assert engine.runner.req_to_token.table.shape == (9, plan.context_len)
        out = llm.generate(input_ids=[5, 6, 7, 8, 9], sampling_params={"max_new_tokens": 3,
                                                                      "temperature": 0})
        assert len(out["output_ids"]) == 3
    finally:
        llm.shutdown()


def test_server_info_shows_resolved_args_plan_and_resolutions(tiny_checkpoints):
    from kvstrata import LLM

    llm = LLM(model_path=tiny_checkpoints["llama"], skip_tokenizer_init=True, page_size=4,
              max_total_tokens=1002)
    try:
        info = llm.server_info()
        # Resolved values, not the flags as given.
        assert info["max_total_tokens"] == 1000 and info["chunked_prefill_size"] == 2048
        assert info["device"] == "cpu" and info["max_running_requests"] == 250
        assert info["context_length"] == llm.engine.kv_plan.context_len
        assert info["kv_plan"] == llm.engine.kv_plan.to_json()
        assert info["kv_plan"]["components"][0]["name"] == "k"
        rules = [r["rule"] for r in info["resolutions"]]
        for rule in ("platform.device", "platform.chunked_prefill_size", "kv_plan.whole_pages",
                     "kv_plan.context_length", "kv_plan.rows"):
            assert rule in rules
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kwargs, match", [
    (dict(page_size=16, max_total_tokens=16, chunked_prefill_size=8),
     "--chunked-prefill-size 8 must be a multiple of --page-size 16"),
    (dict(page_size=16, max_total_tokens=8), "--max-total-tokens 8 is less than one page"),
])
def test_page_geometry_errors_before_the_model_loads(tiny_checkpoints, monkeypatch, kwargs,
                                                     match):
    from kvstrata import LLM
    from kvstrata.runner import model_runner
    def must_not_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(model_runner, "ModelRunner", must_not_load)
    with pytest.raises(ValueError, match=match):
        LLM(model_path=tiny_checkpoints["llama"], skip_tokenizer_init=True, **kwargs)
