"""Step 0c: prefill/decode disaggregation rules (SGLang's PD hook), on every platform."""
from __future__ import annotations

import pytest

from kvstrata.config import ModelInfo, ServerArgs, explain, resolve
from tests.helpers.cli import make_parser, server_args_from_namespace
from kvstrata.config.rules.disagg import (DECODE_CHUNK_CACHE_WARNING,
                                          DECODE_RADIX_CACHE_WARNING, decode_extra_slots)
from kvstrata.platform import simulated

PLATFORMS = ["cuda", "hip", "npu", "xpu", "mps", "cpu"]
PD_FLAGS = ["--disaggregation-mode", "--disaggregation-transfer-backend",
            "--disaggregation-bootstrap-port", "--disaggregation-decode-polling-interval",
            "--disaggregation-decode-extra-slots", "--num-reserved-decode-tokens",
            "--disaggregation-decode-enable-radix-cache"]


def run(platform: str = "cpu", **kwargs):
    resolved, res = resolve(ServerArgs(**kwargs), simulated(platform), ModelInfo(), env={})
    return resolved, {r.field: r for r in res}


@pytest.mark.parametrize("platform", PLATFORMS)
def test_decode_forces_the_chunk_cache(platform):
    resolved, res = run(platform, disaggregation_mode="decode")
    assert resolved.disable_radix_cache is True
    r = res["disable_radix_cache"]
    assert (r.old, r.new, r.rule, r.reason, r.warning) == (
        False, True, "disagg.decode_chunk_cache", DECODE_CHUNK_CACHE_WARNING, True)


@pytest.mark.parametrize("mode", ["null", "prefill"])
def test_other_roles_keep_the_radix_cache(mode):
    resolved, res = run(disaggregation_mode=mode)
    assert resolved.disable_radix_cache is False and "disable_radix_cache" not in res
    assert resolved.disaggregation_decode_extra_slots is None


def test_decode_radix_cache_keeps_the_tree_with_sglangs_warning():
    resolved, res = run(disaggregation_mode="decode",
                        disaggregation_decode_enable_radix_cache=True)
    assert resolved.disable_radix_cache is False
    assert res["disable_radix_cache"].reason == DECODE_RADIX_CACHE_WARNING


@pytest.mark.parametrize("kwargs,message", [
    ({"disaggregation_mode": "prefill", "disaggregation_transfer_backend": "fake"},
     "--disaggregation-transfer-backend fake cannot be used with --disaggregation-mode prefill"),
    ({"disaggregation_mode": "decode", "enable_hierarchical_cache": True},
     "--enable-hierarchical-cache needs a radix cache, and a decode server"),
    ({"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True,
      "disaggregation_transfer_backend": "fake"},
     "--disaggregation-decode-enable-radix-cache is not supported with "
     "--disaggregation-transfer-backend fake"),
    ({"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True,
      "enable_hisparse": True}, "not supported with --enable-hisparse"),
    ({"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True,
      "disable_radix_cache": True}, "contradict"),
    ({"disaggregation_decode_enable_radix_cache": True},
     "--disaggregation-decode-enable-radix-cache requires --disaggregation-mode decode, got null"),
    ({"disaggregation_mode": "prefill", "disaggregation_decode_extra_slots": 4},
     "--disaggregation-decode-extra-slots requires --disaggregation-mode decode, got prefill"),
])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_invalid_combinations_name_the_flags(platform, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run(platform, **kwargs)


def test_decode_with_fake_backend_and_hicache_with_radix_are_allowed():
    run(disaggregation_mode="decode", disaggregation_transfer_backend="fake")
    resolved, _ = run(disaggregation_mode="decode", enable_hierarchical_cache=True,
                      disaggregation_decode_enable_radix_cache=True)
    assert resolved.enable_hierarchical_cache and not resolved.disable_radix_cache


def test_decode_host_tier_and_offload_turn_on_what_they_need():
    """SGLang's spelling turns HiCache on; the offload turns on the decode radix cache and its
    host tier (it writes through them), each with its rule; retraction backups are then
    cpu_tensor (the host pool is HiCache's); a store on a decode server needs the offload."""
    resolved, res = run(disaggregation_mode="decode", disaggregation_decode_enable_hicache=True,
                        disaggregation_decode_enable_radix_cache=True)
    assert resolved.enable_hierarchical_cache
    assert res["enable_hierarchical_cache"].rule == "disagg.decode_hicache"
    resolved, res = run(disaggregation_mode="decode", hicache_storage_backend="file",
                        disaggregation_decode_enable_offload_kvcache=True)
    assert resolved.enable_hierarchical_cache and not resolved.disable_radix_cache
    assert resolved.disaggregation_decode_enable_radix_cache
    assert res["enable_hierarchical_cache"].rule == "disagg.decode_offload"
    assert resolved.disaggregation_decode_retraction_backup == "cpu_tensor"
    assert "--disaggregation-decode-enable-offload-kvcache" in \
        res["disaggregation_decode_retraction_backup"].reason
    with pytest.raises(ValueError, match="is its KV offload"):
        run(disaggregation_mode="decode", hicache_storage_backend="file",
            enable_hierarchical_cache=True, disaggregation_decode_enable_radix_cache=True)
    with pytest.raises(ValueError, match="offload-kvcache requires --hicache-storage-backend"):
        run(disaggregation_mode="decode", disaggregation_decode_enable_offload_kvcache=True)
    with pytest.raises(ValueError, match="requires --disaggregation-mode decode"):
        run(disaggregation_mode="prefill", disaggregation_decode_enable_offload_kvcache=True,
            hicache_storage_backend="file")


@pytest.mark.parametrize("max_running,expected", [(8, 16), (32, 64), (33, 0), (256, 0)])
def test_extra_slots_follow_max_running_requests(max_running, expected):
    resolved, res = run(disaggregation_mode="decode", max_running_requests=max_running)
    assert resolved.disaggregation_decode_extra_slots == expected
    assert res["disaggregation_decode_extra_slots"].rule == "disagg.decode_extra_slots"
    assert decode_extra_slots(None, max_running) == expected
    # explicit wins; unknown max_running_requests leaves it to the sizing step
    assert decode_extra_slots(5, max_running) == 5
    assert decode_extra_slots(None, None) is None
    resolved, res = run(disaggregation_mode="decode", max_running_requests=max_running,
                        disaggregation_decode_extra_slots=3)
    assert resolved.disaggregation_decode_extra_slots == 3
    assert "disaggregation_decode_extra_slots" not in res


def test_chunk_size_rule_still_skips_decode():
    # a decode server never prefills in chunks: a chunk not a multiple of the page is fine
    run(disaggregation_mode="decode", page_size=16, chunked_prefill_size=24)
    with pytest.raises(ValueError, match="multiple of --page-size"):
        run(disaggregation_mode="prefill", page_size=16, chunked_prefill_size=24)


def test_explain_shows_the_pd_resolutions():
    text = explain(ServerArgs(disaggregation_mode="decode"), "cpu")
    assert "disagg.decode_chunk_cache" in text and DECODE_CHUNK_CACHE_WARNING in text


def test_every_pd_flag_is_in_serve_help(capsys):
    from kvstrata.entrypoints.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert [f for f in PD_FLAGS if f not in help_text] == []
    ns = make_parser().parse_args(["--disaggregation-mode", "prefill",
                                   "--disaggregation-bootstrap-port", "9100",
                                   "--disaggregation-decode-polling-interval", "2",
                                   "--disaggregation-decode-extra-slots", "0"])
    args = server_args_from_namespace(ns)
    assert (args.disaggregation_mode, args.disaggregation_bootstrap_port,
            args.disaggregation_decode_polling_interval,
            args.disaggregation_decode_extra_slots) == ("prefill", 9100, 2, 0)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_offline_llm_refuses_pd_modes_before_loading_anything(mode):
    from kvstrata.entrypoints.llm import LLM
    with pytest.raises(ValueError, match=f"^--disaggregation-mode {mode} needs the server"):
        LLM(model_path="/nonexistent", disaggregation_mode=mode)
