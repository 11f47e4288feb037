"""Step 8: deterministic inference (config/rules/deterministic.py): the kernels it pins are
Resolutions (what `kvstrata config --explain` lists), and what it cannot honour is refused by
name rather than served non-deterministically."""
from __future__ import annotations

import pytest

from kvstrata.config import ModelInfo, ServerArgs, resolve
from kvstrata.config.rules import deterministic
from kvstrata.platform import simulated


def run(platform: str = "cpu", model_info: ModelInfo | None = None, **kwargs):
    resolved, res = resolve(ServerArgs(**kwargs), simulated(platform), model_info or ModelInfo(),
                            env={})
    return resolved, {r.field: r for r in res}


def test_the_flag_records_the_pinned_kernels():
    resolved, res = run(enable_deterministic_inference=True)
    assert resolved.deterministic_linear_kernel == deterministic.LINEAR_KERNEL
    assert resolved.deterministic_attention_kernel == deterministic.ATTENTION_KERNEL
    for field in ("deterministic_linear_kernel", "deterministic_attention_kernel"):
        assert res[field].rule == "deterministic.kernels" and res[field].reason


def test_off_by_default_changes_nothing():
    resolved, res = run()
    assert resolved.deterministic_linear_kernel is None
    assert not [f for f in res if f.startswith("deterministic")]
    resolved, res = run(disable_deterministic_inference=True)
    assert resolved.deterministic_attention_kernel is None


@pytest.mark.parametrize("kwargs,platform,info,message", [
    (dict(disable_deterministic_inference=True), "cpu", None, "contradict each other"),
    ({}, "cuda", None, "not implemented yet on cuda"),
    (dict(device="cuda"), "cuda", None, "not implemented yet on cuda"),
    ({}, "cpu", ModelInfo(kv_pool_kind="mla", uses_dsa=True), "not implemented yet for a mla"),
    ({}, "cpu", ModelInfo(kv_pool_kind="swa"), "not implemented yet for a swa"),
    (dict(quantization="w8a8_int8"), "cpu", None, "--quantization w8a8_int8"),
])
def test_what_it_cannot_honour_is_refused_by_name(kwargs, platform, info, message):
    with pytest.raises(ValueError, match="--enable-deterministic-inference") as err:
        run(platform, info, enable_deterministic_inference=True, **kwargs)
    assert message in str(err.value)
