"""ServerArgs: defaults, generated CLI, validation messages, unknown kwargs."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from kvstrata.config import ServerArgs
from tests.helpers.cli import make_parser, server_args_from_namespace

EXPECTED_DEFAULTS = {
    "model_path": "smollm2-135m", "tokenizer_path": None, "served_model_name": None,
    "host": "127.0.0.1", "port": 30000, "api_key": None, "dtype": "auto", "page_size": 1,
    "max_total_tokens": None, "max_running_requests": None, "max_prefill_tokens": 16384,
    "chunked_prefill_size": None, "schedule_policy": "fcfs", "schedule_conservativeness": 1.0,
    "disable_radix_cache": False, "radix_eviction_policy": "lru", "log_level": "info",
    "random_seed": None, "context_length": None, "mem_fraction_static": None, "device": None,
    "platform": None, "stream_interval": 1, "enable_metrics": True,
    # issue 4 groups
    "enable_hierarchical_cache": False, "hicache_ratio": None, "hicache_size": 0,
    "hicache_write_policy": "write_through", "hicache_io_backend": "kernel",
    "hicache_mem_layout": "page_first", "hicache_host_memory_mode": "cache",
    "hicache_storage_backend": None, "hicache_storage_prefetch_policy": "timeout",
    "hicache_storage_backend_extra_config": None, "disaggregation_mode": "null",
    "disaggregation_transfer_backend": "tcp", "disaggregation_bootstrap_port": 8998,
    "disaggregation_decode_retraction_backup": None,
    "disaggregation_decode_enable_radix_cache": False,
    "disaggregation_decode_enable_offload_kvcache": False, "num_reserved_decode_tokens": 512,
    "disaggregation_decode_polling_interval": 1, "disaggregation_decode_extra_slots": None,
    "enable_priority_scheduling": False, "disable_priority_preemption": False,
    "default_priority_value": None, "abort_on_priority_when_disabled": False,
    "schedule_low_priority_values_first": False, "priority_scheduling_preemption_threshold": 10,
    "max_queued_requests": None, "tp_size": 1,
    "dcp_size": 1, "enable_hisparse": False,
}

EXPECTED_CHOICES = {
    "dtype": ["auto", "float32", "bfloat16", "float16"],
    "schedule_policy": ["fcfs", "lpm", "lof"],
    "radix_eviction_policy": ["lru", "lfu"],
    "hicache_write_policy": ["write_back", "write_through", "write_through_selective"],
    "hicache_io_backend": ["direct", "kernel"],
    "hicache_mem_layout": ["layer_first", "page_first", "page_first_direct", "page_head"],
    "hicache_host_memory_mode": ["cache", "buffer_only"],
    "hicache_storage_backend": ["file", "mooncake", "memory"],
    "hicache_storage_prefetch_policy": ["best_effort", "wait_complete", "timeout"],
    "disaggregation_mode": ["null", "prefill", "decode"],
    "disaggregation_transfer_backend": ["tcp", "mooncake", "fake"],
    "disaggregation_decode_retraction_backup": ["cpu_tensor", "host_pool"],
    "platform": ["cuda", "hip", "npu", "xpu", "mps", "cpu"],
}


def _actions() -> dict[str, argparse.Action]:
    return {a.dest: a for a in make_parser()._actions if a.dest != "help"}


def test_defaults():
    args = ServerArgs()
    for name, value in EXPECTED_DEFAULTS.items():
        assert getattr(args, name) == value, name


def test_cli_defaults_equal_dataclass_defaults():
    assert server_args_from_namespace(make_parser().parse_args([])) == ServerArgs()


def test_every_field_is_a_dashed_flag_with_help():
    actions = _actions()
    assert set(actions) == set(ServerArgs.field_names())
    for f in dataclasses.fields(ServerArgs):
        action = actions[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        assert action.help and f.metadata["help"].split(" (")[0][:20] in action.help


@pytest.mark.parametrize("name,choices", sorted(EXPECTED_CHOICES.items()))
def test_choices(name, choices):
    assert list(_actions()[name].choices) == choices


def test_parse_flags():
    ns = make_parser().parse_args([
        "--page-size", "16", "--enable-hierarchical-cache", "--hicache-ratio", "1.5",
        "--hicache-mem-layout", "page_head", "--disaggregation-mode", "decode",
        "--no-enable-metrics", "--chunked-prefill-size", "-1", "--tp-size", "2"])
    args = server_args_from_namespace(ns)
    assert (args.page_size, args.enable_hierarchical_cache, args.hicache_ratio) == (16, True, 1.5)
    assert args.hicache_mem_layout == "page_head" and args.disaggregation_mode == "decode"
    assert args.enable_metrics is False and args.chunked_prefill_size == -1 and args.tp_size == 2


def test_cli_rejects_bad_choice():
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--hicache-io-backend", "kernel_ascend"])


def test_namespace_extras_are_ignored():
    ns = make_parser().parse_args([])
    ns.json = True  # a CLI may add its own flags to the same parser
    assert server_args_from_namespace(ns) == ServerArgs()


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerArgs().page_size = 2  # type: ignore[misc]


@pytest.mark.parametrize("kwargs,message", [
    ({"page_size": 0}, "--page-size must be >= 1, got 0"),
    ({"port": 0}, "--port must be in 1..65535, got 0"),
    ({"disaggregation_bootstrap_port": 70000}, "--disaggregation-bootstrap-port must be in"),
    ({"max_total_tokens": 0}, "--max-total-tokens must be >= 1, got 0"),
    ({"max_running_requests": -1}, "--max-running-requests must be >= 1"),
    ({"max_prefill_tokens": 0}, "--max-prefill-tokens must be >= 1"),
    ({"chunked_prefill_size": 0}, "--chunked-prefill-size must be >= 1 or -1 (disabled), got 0"),
    ({"chunked_prefill_size": -2}, "--chunked-prefill-size must be >= 1 or -1"),
    ({"schedule_conservativeness": 0.0}, "--schedule-conservativeness must be > 0"),
    ({"mem_fraction_static": 1.0}, "--mem-fraction-static must be in (0, 1)"),
    ({"context_length": 0}, "--context-length must be >= 1"),
    ({"stream_interval": 0}, "--stream-interval must be >= 1"),
    ({"tp_size": 0}, "--tp-size must be >= 1"),
    ({"dcp_size": 0}, "--dcp-size must be >= 1"),
    ({"hicache_ratio": 0.0}, "--hicache-ratio must be > 0"),
    ({"hicache_size": -1}, "--hicache-size must be >= 0"),
    ({"num_reserved_decode_tokens": -1}, "--num-reserved-decode-tokens must be >= 0"),
    ({"disaggregation_decode_polling_interval": 0},
     "--disaggregation-decode-polling-interval must be >= 1, got 0"),
    ({"disaggregation_decode_extra_slots": -1},
     "--disaggregation-decode-extra-slots must be >= 0, got -1"),
    ({"dtype": "fp8"}, "--dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"),
    ({"hicache_mem_layout": "page_first_kv_split"}, "--hicache-mem-layout must be one of"),
    ({"disaggregation_mode": "both"}, "--disaggregation-mode must be one of"),
    ({"device": "tpu"}, "--device must be one of"),
    ({"page_size": "4"}, "--page-size must be int, got '4'"),
    ({"page_size": True}, "--page-size must be int, got True"),
    ({"page_size": None}, "--page-size must be int, got None"),
    ({"enable_hisparse": 1}, "--enable-hisparse must be a bool, got 1"),
    ({"model_path": None}, "--model-path must be a string, got None"),
    ({"enable_hierarchical_cache": True, "disable_radix_cache": True},
     "--enable-hierarchical-cache and --disable-radix-cache are mutually exclusive"),
    ({"hicache_storage_backend_extra_config": "{not json"},
     "--hicache-storage-backend-extra-config is not valid JSON"),
    ({"hicache_storage_backend_extra_config": "[1]"},
     "--hicache-storage-backend-extra-config must be a JSON object"),
])
def test_validation_names_the_flag(kwargs, message):
    with pytest.raises(ValueError) as info:
        ServerArgs(**kwargs)
    assert message in str(info.value)


def test_unknown_kwargs_are_named():
    with pytest.raises(TypeError, match=r"unknown argument\(s\): 'page_sise' \(did you mean "
                                        r"'page_size'\?\), 'bogus'"):
        ServerArgs(page_sise=4, bogus=1)


def test_float_fields_accept_ints():
    assert ServerArgs(hicache_ratio=2, hicache_size=1).hicache_ratio == 2


def test_extra_config_json_and_file(tmp_path):
    assert ServerArgs().hicache_storage_extra_config() == {}
    assert ServerArgs(hicache_storage_backend_extra_config='{"a": 1}') \
        .hicache_storage_extra_config() == {"a": 1}
    path = tmp_path / "extra.json"
    path.write_text(json.dumps({"b": 2}))
    args = ServerArgs(hicache_storage_backend_extra_config=f"@{path}")
    assert args.hicache_storage_extra_config() == {"b": 2}


def test_derived_properties_and_replace():
    args = ServerArgs(enable_priority_scheduling=True)
    assert args.priority_preemption
    assert not args.replace(disable_priority_preemption=True).priority_preemption
    assert not args.dcp_enabled and args.replace(dcp_size=2).dcp_enabled
    with pytest.raises(ValueError, match="--page-size"):
        args.replace(page_size=0)


def test_pickle_round_trip():
    # the launcher hands args to spawned processes
    import pickle

    from kvstrata.config import ModelInfo, resolve
    from kvstrata.platform import simulated
    args = ServerArgs(page_size=4, enable_hierarchical_cache=True)
    assert pickle.loads(pickle.dumps(args)) == args
    resolved, res = resolve(args, simulated("cuda"), ModelInfo(), env={})
    assert pickle.loads(pickle.dumps((resolved, res))) == (resolved, res)
