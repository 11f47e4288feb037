"""Resolution steps 0-4 (platform defaults, HiCache mode/layout/IO/storage/ratio) on every
simulated platform, with the exact warning texts."""
from __future__ import annotations

import re

import pytest

from kvstrata.config import ModelInfo, Resolution, ServerArgs, resolve
from kvstrata.platform import simulated

PLATFORMS = ["cuda", "hip", "npu", "xpu", "mps", "cpu"]
R1 = ("Kernel io backend does not support page first direct layout, switching to direct io "
      "backend")
R2 = ("Page first layout is not supported with direct IO backend, switching to page first "
      "direct layout")
HICACHE = {"enable_hierarchical_cache": True}


def run(platform: str, **kwargs):
    return resolve(ServerArgs(**kwargs), simulated(platform), ModelInfo(), env={})


def by_field(resolutions: list[Resolution]) -> dict[str, Resolution]:
    return {r.field: r for r in resolutions}


@pytest.mark.parametrize("platform", PLATFORMS)
def test_platform_defaults(platform):
    resolved, res = run(platform)
    expected_device = {"hip": "cuda"}.get(platform, platform)
    assert resolved.device == expected_device
    assert resolved.chunked_prefill_size == (2048 if platform == "cpu" else 8192)
    r = by_field(res)
    assert r["device"].rule == "platform.device" and r["device"].old is None
    assert r["chunked_prefill_size"].rule == "platform.chunked_prefill_size"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_explicit_platform_values_kept(platform):
    resolved, res = run(platform, device="cpu", chunked_prefill_size=-1)
    assert (resolved.device, resolved.chunked_prefill_size) == ("cpu", -1)
    assert {"device", "chunked_prefill_size"}.isdisjoint(by_field(res))
    # an explicit CPU device on an accelerator gets the CPU chunk size when unset
    assert run(platform, device="cpu")[0].chunked_prefill_size == 2048


@pytest.mark.parametrize("platform,device", [("hip", "npu"), ("npu", "cuda"), ("xpu", "cuda"),
                                             ("mps", "cuda"), ("cpu", "cuda"), ("cuda", "mps")])
def test_device_must_exist_on_platform(platform, device):
    with pytest.raises(ValueError, match=f"--device {device} is not available on the "
                                         f"{platform} platform"):
        run(platform, device=device)
    usable = "(use cpu)" if platform == "cpu" else "or cpu)"
    with pytest.raises(ValueError, match=re.escape(usable)):
        run(platform, device=device)


def test_hip_runs_on_cuda_devices():
    assert run("hip", device="cuda")[0].device == "cuda"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_r1_page_first_direct_with_kernel_switches_io(platform):
    resolved, res = run(platform, hicache_mem_layout="page_first_direct", **HICACHE)
    assert (resolved.hicache_mem_layout, resolved.hicache_io_backend) == (
        "page_first_direct", "direct")
    assert by_field(res)["hicache_io_backend"] == Resolution(
        "hicache_io_backend", "kernel", "direct", "hicache.layout_io.R1", R1, True)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_r2_page_first_with_direct_switches_layout(platform):
    resolved, res = run(platform, hicache_io_backend="direct", **HICACHE)
    assert (resolved.hicache_mem_layout, resolved.hicache_io_backend) == (
        "page_first_direct", "direct")
    assert by_field(res)["hicache_mem_layout"] == Resolution(
        "hicache_mem_layout", "page_first", "page_first_direct", "hicache.layout_io.R2", R2,
        True)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_page_first_kernel_unchanged_everywhere(platform):
    # the historic ROCm rewrite to layer_first must not come back
    resolved, res = run(platform, **HICACHE)
    assert (resolved.hicache_mem_layout, resolved.hicache_io_backend) == ("page_first", "kernel")
    assert {"hicache_mem_layout", "hicache_io_backend"}.isdisjoint(by_field(res))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("layout,io", [("page_first_direct", "direct"), ("layer_first", "kernel"),
                                       ("layer_first", "direct"), ("page_head", "kernel")])
def test_compatible_pairs_unchanged(platform, layout, io):
    resolved, res = run(platform, hicache_mem_layout=layout, hicache_io_backend=io, **HICACHE)
    assert (resolved.hicache_mem_layout, resolved.hicache_io_backend) == (layout, io)
    assert not [r for r in res if r.warning]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_page_head_requires_kernel(platform):
    with pytest.raises(ValueError, match="--hicache-mem-layout page_head requires "
                                         "--hicache-io-backend kernel, got direct"):
        run(platform, hicache_mem_layout="page_head", hicache_io_backend="direct", **HICACHE)


def test_layout_rules_skipped_without_a_host_pool():
    resolved, res = run("cuda", hicache_io_backend="direct")
    assert resolved.hicache_mem_layout == "page_first"
    assert not [r for r in res if r.warning]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("io,layout", [("kernel", "page_first"), ("direct", "page_first_direct")])
def test_mooncake_layer_first(platform, io, layout):
    resolved, res = run(platform, hicache_storage_backend="mooncake",
                        hicache_mem_layout="layer_first", hicache_io_backend=io, **HICACHE)
    assert (resolved.hicache_mem_layout, resolved.hicache_io_backend) == (layout, io)
    r = by_field(res)["hicache_mem_layout"]
    assert (r.old, r.new, r.rule, r.warning) == ("layer_first", layout,
                                                 "hicache.storage_layout", True)
    assert r.reason == (f"Mooncake storage backend does not support layer_first layout, "
                        f"switching to {layout} layout for {io} io backend")
    assert "hicache_io_backend" not in by_field(res)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_file_storage_keeps_layer_first(platform):
    resolved, _ = run(platform, hicache_storage_backend="file", hicache_mem_layout="layer_first",
                      **HICACHE)
    assert resolved.hicache_mem_layout == "layer_first"


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("extra,ratio", [({}, 2.0),
                                         ({"hicache_host_memory_mode": "buffer_only",
                                           "hicache_storage_backend": "file"}, 1.2)])
def test_ratio_default_non_decode(platform, extra, ratio):
    resolved, res = run(platform, **HICACHE, **extra)
    assert resolved.hicache_ratio == ratio
    assert by_field(res)["hicache_ratio"].rule == "hicache.ratio_default"


def test_explicit_ratio_and_size_kept():
    assert run("cuda", hicache_ratio=3.5, **HICACHE)[0].hicache_ratio == 3.5
    resolved, res = run("cuda", hicache_size=4, **HICACHE)
    assert resolved.hicache_size == 4 and "takes precedence" in by_field(res)["hicache_ratio"].reason


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kwargs,message", [
    ({"hicache_host_memory_mode": "buffer_only"},
     "--hicache-host-memory-mode buffer_only requires --hicache-storage-backend"),
    ({"hicache_host_memory_mode": "buffer_only", "hicache_storage_backend": "file",
      "hicache_write_policy": "write_back"},
     "--hicache-host-memory-mode buffer_only does not support --hicache-write-policy write_back"),
    ({"hicache_host_memory_mode": "buffer_only", "hicache_storage_backend": "file",
      "disaggregation_mode": "decode"},
     "--hicache-host-memory-mode buffer_only is not supported with --disaggregation-mode decode"),
    ({"disaggregation_decode_enable_offload_kvcache": True, "hicache_storage_backend": "file"},
     "--disaggregation-decode-enable-offload-kvcache requires --disaggregation-mode decode"),
    ({"disaggregation_decode_enable_offload_kvcache": True, "disaggregation_mode": "decode"},
     "--disaggregation-decode-enable-offload-kvcache requires --hicache-storage-backend"),
])
def test_host_memory_mode_errors(platform, kwargs, message):
    with pytest.raises(ValueError) as info:
        run(platform, **kwargs)
    assert message in str(info.value)


def test_resolution_is_pure_and_frozen():
    args = ServerArgs(hicache_io_backend="direct", **HICACHE)
    first = resolve(args, simulated("cuda"), ModelInfo(), env={})
    second = resolve(args, simulated("cuda"), ModelInfo(), env={})
    assert first == second
    assert args.hicache_mem_layout == "page_first"  # input untouched
    assert isinstance(first[0], ServerArgs)


def test_platform_from_args_flag():
    resolved, _ = resolve(ServerArgs(platform="npu"), model_info=ModelInfo(), env={})
    assert resolved.device == "npu"
