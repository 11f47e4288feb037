"""Step 5: decode-retraction backup and the hicache ratio that follows it."""
from __future__ import annotations

import pytest

from kvstrata.config import ModelInfo, ServerArgs, resolve
from kvstrata.config.rules.retraction import RetractionInputs, decide_backup
from kvstrata.platform import simulated

PLATFORMS = ["cuda", "hip", "npu", "xpu", "mps", "cpu"]
DECODE = {"disaggregation_mode": "decode"}


def run(platform: str, model_info: ModelInfo | None = None, **kwargs):
    resolved, res = resolve(ServerArgs(**kwargs), simulated(platform),
                            model_info or ModelInfo(), env={})
    return resolved, {r.field: r for r in res}


def outcome(platform: str, model_info: ModelInfo | None = None, **kwargs):
    resolved, _ = run(platform, model_info, **kwargs)
    return resolved.disaggregation_decode_retraction_backup, resolved.hicache_ratio


@pytest.mark.parametrize("platform", PLATFORMS)
def test_auto_decode(platform):
    # SGLang's own unit test: cuda -> host_pool/0.2; hip -> cpu_tensor/2.0
    expected = ("cpu_tensor", 2.0) if platform == "hip" else ("host_pool", 0.2)
    assert outcome(platform, **DECODE) == expected
    _, res = run(platform, **DECODE)
    assert res["disaggregation_decode_retraction_backup"].rule == "retraction.backup"
    assert res["hicache_ratio"].rule == "retraction.ratio"
    if platform == "hip":
        assert "ROCm" in res["disaggregation_decode_retraction_backup"].reason


def test_explicit_host_pool_on_hip_is_kept():
    assert outcome("hip", disaggregation_decode_retraction_backup="host_pool", **DECODE) == (
        "host_pool", 0.2)
    _, res = run("hip", disaggregation_decode_retraction_backup="host_pool", **DECODE)
    assert "disaggregation_decode_retraction_backup" not in res


@pytest.mark.parametrize("platform", PLATFORMS)
def test_explicit_cpu_tensor_kept(platform):
    assert outcome(platform, disaggregation_decode_retraction_backup="cpu_tensor", **DECODE) == (
        "cpu_tensor", 2.0)


@pytest.mark.parametrize("platform", ["cuda", "npu", "xpu", "mps", "cpu"])
@pytest.mark.parametrize("kwargs,model_info", [
    ({"disaggregation_mode": "null"}, None),
    ({"disaggregation_mode": "prefill"}, None),
    ({"dcp_size": 2}, None),
    ({"disaggregation_decode_enable_radix_cache": True}, None),
    ({"disaggregation_decode_enable_offload_kvcache": True, "hicache_storage_backend": "file"},
     None),
    ({"enable_priority_scheduling": True}, None),
    ({}, ModelInfo(kv_pool_kind="mla")),
    ({}, ModelInfo(kv_pool_kind="other")),
    ({}, ModelInfo(kv_pool_kind="swa", full_attention_tokens_per_layer=0)),  # all-SWA
])
def test_each_single_condition_flips_auto_to_cpu_tensor(platform, kwargs, model_info):
    args = {**DECODE, **kwargs}
    assert outcome(platform, model_info, **args) == ("cpu_tensor", 2.0)


@pytest.mark.parametrize("platform", ["cuda", "npu", "xpu", "mps", "cpu"])
def test_conditions_that_keep_host_pool(platform):
    # priority scheduling without preemption
    assert outcome(platform, enable_priority_scheduling=True, disable_priority_preemption=True,
                   **DECODE) == ("host_pool", 0.2)
    # a hybrid SWA pool (SGLang's gate: full-attention tokens > 0; None: hybrid, not sized
    # yet -- rules/swa.py model_info_after gives an all-SWA model 0): the backup keeps the
    # full pages and the live window's SWA pages
    for tokens in (4096, None):
        info = ModelInfo(kv_pool_kind="swa", full_attention_tokens_per_layer=tokens)
        assert outcome(platform, info, **DECODE) == ("host_pool", 0.2)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_ratio_2_when_hicache_enabled(platform):
    # a decode server with HiCache shares the host pool: standard 2.0. (HiCache on a decode
    # server needs its radix cache: rules/disagg.py refuses it over the chunk cache.)
    hicache = {"enable_hierarchical_cache": True,
               "disaggregation_decode_enable_radix_cache": True, **DECODE}
    assert outcome(platform, **hicache)[1] == 2.0
    assert outcome(platform, disaggregation_decode_retraction_backup="host_pool", **hicache) == (
        "host_pool", 2.0)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_explicit_ratio_kept(platform):
    assert outcome(platform, hicache_ratio=0.5, **DECODE)[1] == 0.5


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kwargs,model_info,message", [
    ({"disaggregation_mode": "null"}, None,
     "--disaggregation-decode-retraction-backup host_pool requires --disaggregation-mode "
     "decode, got null"),
    ({"disaggregation_mode": "prefill"}, None, "requires --disaggregation-mode decode, got "
                                               "prefill"),
    ({"dcp_size": 2, **DECODE}, None,
     "--disaggregation-decode-retraction-backup host_pool is not supported with --dcp-size > 1"),
    ({"enable_priority_scheduling": True, **DECODE}, None,
     "--disaggregation-decode-retraction-backup host_pool with --enable-priority-scheduling "
     "requires --disable-priority-preemption"),
    ({"disaggregation_decode_enable_offload_kvcache": True, "hicache_storage_backend": "file",
      **DECODE}, None,
     "--disaggregation-decode-retraction-backup host_pool and "
     "--disaggregation-decode-enable-offload-kvcache are mutually exclusive"),
    (DECODE, ModelInfo(kv_pool_kind="swa", full_attention_tokens_per_layer=0),
     "does not support a pure sliding-window KV pool"),
])
def test_explicit_host_pool_errors(platform, kwargs, model_info, message):
    with pytest.raises(ValueError) as info:
        run(platform, model_info, disaggregation_decode_retraction_backup="host_pool", **kwargs)
    assert message in str(info.value)


def test_recurrent_state_takes_cpu_tensor_and_refuses_host_pool():
    """The rule alone and through the pipeline (a PD decode server of a recurrent model: the
    host pool would carry no state slot, SGLang's reason)."""
    from kvstrata.config.resolve_types import to_resolved  # noqa: PLC0415
    from kvstrata.config.rules.retraction import retraction_backup  # noqa: PLC0415

    info = ModelInfo(has_recurrent_state=True)
    res = retraction_backup(to_resolved(ServerArgs(**DECODE)), simulated("cuda"), info, {})
    assert res[0].new == "cpu_tensor" and "recurrent/SSM state" in res[0].reason
    with pytest.raises(ValueError, match="does not support models with recurrent/SSM"):
        retraction_backup(to_resolved(ServerArgs(
            disaggregation_decode_retraction_backup="host_pool", **DECODE)),
            simulated("cuda"), info, {})
    resolved, _ = run("cuda", info, **DECODE)
    assert resolved.disaggregation_decode_retraction_backup == "cpu_tensor"


def test_decide_backup_is_pure():
    base = RetractionInputs("decode", None, "cuda", False, False, False, False, False, False,
                            "mha", None)
    assert decide_backup(base)[0] == "host_pool"
    assert decide_backup(base)[0] == "host_pool"
    backend, reason = decide_backup(RetractionInputs("decode", None, "hip", True, True, False,
                                                     False, False, False, "mha", None))
    assert backend == "cpu_tensor" and "ROCm" in reason and "--dcp-size" in reason
