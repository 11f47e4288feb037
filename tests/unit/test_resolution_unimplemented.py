"""Flags whose feature is not built yet are refused by serve (never a silent no-op); the
typed KVSTRATA_* environment registry."""
from __future__ import annotations

import pytest

from kvstrata import envs
from kvstrata.config import ServerArgs, check_serve_platform, refuse_unimplemented
from kvstrata.config import unimplemented_flags
from kvstrata.platform import simulated


def test_defaults_are_all_implemented():
    assert unimplemented_flags(ServerArgs()) == []
    refuse_unimplemented(ServerArgs())


@pytest.mark.parametrize("kwargs,flag", [
    ({"hicache_host_memory_mode": "buffer_only"}, "--hicache-host-memory-mode"),
    ({"enable_hisparse": True}, "--enable-hisparse"),
    ({"tp_size": 2, "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "d"},
     "--speculative-algorithm EAGLE3 with --tp-size > 1"),
    ({"tp_size": 2, "speculative_algorithm": "EAGLE", "speculative_draft_model_path": "d",
      "speculative_token_map": "m"}, "--speculative-token-map with --tp-size > 1"),
    ({"dcp_size": 2}, "--dcp-size"),
])
def test_unbuilt_flag_is_refused(kwargs, flag):
    args = ServerArgs(**kwargs)
    assert unimplemented_flags(args) == [flag]
    with pytest.raises(NotImplementedError, match=f"^not implemented yet: {flag}$"):
        refuse_unimplemented(args)


@pytest.mark.parametrize("kwargs", [
    {"hicache_storage_backend": "file"}, {"hicache_storage_prefetch_policy": "best_effort"},
    {"hicache_storage_backend_extra_config": "{}"},
    {"disaggregation_mode": "prefill"}, {"disaggregation_mode": "decode"},
    {"disaggregation_transfer_backend": "mooncake"}, {"disaggregation_transfer_backend": "fake"},
    {"disaggregation_bootstrap_port": 9000}, {"num_reserved_decode_tokens": 256},
    {"disaggregation_decode_polling_interval": 4}, {"disaggregation_decode_extra_slots": 8},
    {"disaggregation_mode": "decode", "disaggregation_decode_retraction_backup": "cpu_tensor"},
    {"disaggregation_mode": "decode", "disaggregation_decode_retraction_backup": "host_pool"},
    {"enable_priority_scheduling": True}, {"disable_priority_preemption": True},
    {"enable_priority_scheduling": True, "schedule_policy": "lof"},
    {"max_queued_requests": 4}, {"abort_on_priority_when_disabled": True},
    {"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True,
     "enable_hierarchical_cache": True, "disaggregation_decode_retraction_backup": "host_pool"},
    {"tp_size": 2}, {"tp_size": 2, "speculative_algorithm": "NGRAM"},
    {"tp_size": 2, "speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "d"},
    {"tp_size": 2, "speculative_algorithm": "EAGLE", "speculative_draft_model_path": "d"},
    {"tp_size": 2, "disaggregation_mode": "decode"},
    {"tp_size": 2, "enable_hierarchical_cache": True,
                     "hicache_storage_backend": "file"}, {"tp_size": 4, "nnodes": 2, "node_rank": 1,
                     "dist_init_addr": "127.0.0.1:5000"},
    {"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True,
     "enable_hierarchical_cache": True},
    {"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True,
     "disaggregation_decode_enable_hicache": True},
    {"disaggregation_mode": "decode", "disaggregation_decode_enable_offload_kvcache": True,
     "hicache_storage_backend": "file"},
])
def test_pd_flags_are_built(kwargs):
    """PD roles, backends, the bootstrap port, decode admission and decode retraction are
    built: serve accepts them (the decode radix cache and KV offload stay refused above)."""
    assert unimplemented_flags(ServerArgs(**kwargs)) == []
    refuse_unimplemented(ServerArgs(**kwargs))


def test_several_flags_listed_in_field_order():
    args = ServerArgs(enable_hisparse=True, dcp_size=4, hicache_host_memory_mode="buffer_only")
    assert unimplemented_flags(args) == ["--dcp-size", "--hicache-host-memory-mode",
                                         "--enable-hisparse"]


def test_serve_refuses_a_simulated_platform():
    check_serve_platform(ServerArgs(platform="cpu"), simulated("cpu"))
    with pytest.raises(ValueError, match="--platform cuda does not match this machine"):
        check_serve_platform(ServerArgs(platform="cuda"), simulated("cpu"))


# ---- KVSTRATA_* registry -------------------------------------------------------------------

def test_dsa_fuse_topk_default_and_parsing():
    var = envs.KVSTRATA_DSA_FUSE_TOPK
    assert var.get({}) is True
    for raw, value in [("0", False), ("false", False), ("OFF", False), ("1", True),
                       ("True", True), ("yes", True)]:
        assert var.get({var.name: raw}) is value


def test_bad_bool_names_the_variable():
    with pytest.raises(ValueError, match="KVSTRATA_DSA_FUSE_TOPK='maybe' is not a boolean"):
        envs.KVSTRATA_DSA_FUSE_TOPK.get({"KVSTRATA_DSA_FUSE_TOPK": "maybe"})


def test_registry_snapshot_and_unknown():
    snap = envs.snapshot({"KVSTRATA_CHECK_INTEGRITY": "1"})
    assert snap["KVSTRATA_CHECK_INTEGRITY"] is True and snap["KVSTRATA_DSA_FUSE_TOPK"] is True
    assert all(name.startswith("KVSTRATA_") for name in envs.REGISTRY)
    assert envs.unknown_variables({"KVSTRATA_DSA_FUSE_TOPKK": "1", "PATH": "x"}) == [
        "KVSTRATA_DSA_FUSE_TOPKK"]
    with pytest.raises(KeyError, match="not a registered"):
        envs.get("KVSTRATA_NOPE")


def test_quantization_refusal_names_the_value():
    """w8a8_int8 and the checkpoint schemes (gptq, awq and their marlin names,
    compressed-tensors, fp8: config/hf_quant.py checks them against the checkpoint) are
    built: SGLang's other --quantization values are refused by name; a value SGLang does not
    know either is a plain choice error."""
    for built in ("w8a8_int8", "gguf", "gptq", "gptq_marlin", "awq", "awq_marlin", "marlin",
                  "compressed-tensors", "fp8"):
        assert unimplemented_flags(ServerArgs(quantization=built)) == []
        refuse_unimplemented(ServerArgs(quantization=built))
    with pytest.raises(NotImplementedError,
                       match="^not implemented yet: --quantization bitsandbytes$"):
        refuse_unimplemented(ServerArgs(quantization="bitsandbytes"))
    with pytest.raises(ValueError, match="--quantization must be one of"):
        ServerArgs(quantization="int3")


@pytest.mark.parametrize("kwargs,message", [
    ({"tp_size": 2, "nnodes": 2}, "--nnodes > 1 needs --dist-init-addr"),
    ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "--nnodes 2 must divide --tp-size 3"),
    ({"nnodes": 2, "tp_size": 2, "node_rank": 2, "dist_init_addr": "h:1"},
     "--node-rank must be < --nnodes 2"),
    ({"dist_init_addr": "no-port"}, "--dist-init-addr must be host:port"),
    ({"nnodes": 0}, "--nnodes must be >= 1"),
])
def test_node_flags_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)
