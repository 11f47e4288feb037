"""Steps 1-4: HiCache host-memory mode, layout/IO compatibility, storage/layout, ratio default.

None of these rules looks at the platform. SGLang once rewrote `page_first` + `kernel` to
`layer_first` on ROCm (a fallback that outlived its reason); here `page_first` + `kernel` stays
as is everywhere, and a test pins that on every simulated platform.
"""
from __future__ import annotations

from kvstrata.config.kv_plan import IO_BACKEND_LAYOUTS
from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs, change
from kvstrata.platform import Platform

R1_WARNING = ("Kernel io backend does not support page first direct layout, switching to "
              "direct io backend")
R2_WARNING = ("Page first layout is not supported with direct IO backend, switching to page "
              "first direct layout")
# Storage backends whose zero-copy paths need a page-major host layout.
PAGE_MAJOR_STORAGE_BACKENDS = {"mooncake": "Mooncake"}
DEFAULT_HICACHE_RATIO = 2.0
DEFAULT_BUFFER_ONLY_RATIO = 1.2


def storage_layout_warning(backend: str, new_layout: str, io_backend: str) -> str:
    name = PAGE_MAJOR_STORAGE_BACKENDS.get(backend, backend)
    return (f"{name} storage backend does not support layer_first layout, switching to "
            f"{new_layout} layout for {io_backend} io backend")


def hicache_normalisation_applies(args: ResolvedArgs) -> bool:
    """SGLang runs the HiCache normalisation for HiCache, decode KV offload, and a decode
    server whose retraction backup may be a host pool (None or host_pool) — the latter two
    build a host pool too, so its layout/IO must be consistent."""
    return (args.enable_hierarchical_cache or args.disaggregation_decode_enable_offload_kvcache
            or (args.disaggregation_mode == "decode"
                and args.disaggregation_decode_retraction_backup in (None, "host_pool")))


def host_memory_mode(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                     env: dict) -> list[Resolution]:
    """Step 1: validations only (buffer_only constraints, decode KV offload prerequisites)."""
    if args.hicache_host_memory_mode == "buffer_only":
        if args.hicache_storage_backend is None:
            raise ValueError("--hicache-host-memory-mode buffer_only requires "
                             "--hicache-storage-backend (the host pool only stages transfers "
                             "to storage)")
        if args.hicache_write_policy == "write_back":
            raise ValueError("--hicache-host-memory-mode buffer_only does not support "
                             "--hicache-write-policy write_back (nothing would persist evicted "
                             "pages)")
        if args.disaggregation_mode == "decode":
            raise ValueError("--hicache-host-memory-mode buffer_only is not supported with "
                             "--disaggregation-mode decode")
    if args.disaggregation_decode_enable_offload_kvcache:
        if args.disaggregation_mode != "decode":
            raise ValueError("--disaggregation-decode-enable-offload-kvcache requires "
                             "--disaggregation-mode decode")
        if args.hicache_storage_backend is None:
            raise ValueError("--disaggregation-decode-enable-offload-kvcache requires "
                             "--hicache-storage-backend")
    elif args.disaggregation_mode == "decode" and args.hicache_storage_backend is not None:
        raise ValueError("--hicache-storage-backend on a decode server is its KV offload: add "
                         "--disaggregation-decode-enable-offload-kvcache (a decode server "
                         "never reads L3: its prompts' KV comes from the prefill server)")
    return []


def layout_io(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
              env: dict) -> list[Resolution]:
    """Step 2: R1, R2 and the page_head requirement. R1 is checked first; after R1 the layout
    is page_first_direct, so R2 can never undo it."""
    if not hicache_normalisation_applies(args):
        return []
    layout, io = args.hicache_mem_layout, args.hicache_io_backend
    if layout == "page_head" and model_info is not None and model_info.kv_pool_kind == "mla":
        # page_head splits a page by KV head; an MLA latent has no heads (one row per token).
        raise ValueError("--hicache-mem-layout page_head is MHA-only (it splits pages by KV "
                         "head); an MLA model keeps one latent row per token: use layer_first, "
                         "page_first or page_first_direct")
    if layout == "page_first_direct" and io == "kernel":
        return change(args, "hicache_io_backend", "direct", "hicache.layout_io.R1", R1_WARNING,
                      warning=True)
    if layout == "page_first" and io == "direct":
        return change(args, "hicache_mem_layout", "page_first_direct", "hicache.layout_io.R2",
                      R2_WARNING, warning=True)
    if layout not in IO_BACKEND_LAYOUTS[io]:  # after R1/R2 only page_head + direct is left
        able = " or ".join(b for b, ok in IO_BACKEND_LAYOUTS.items() if layout in ok)
        raise ValueError(f"--hicache-mem-layout {layout} requires --hicache-io-backend {able}, "
                         f"got {io}")
    return []


def storage_layout(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                   env: dict) -> list[Resolution]:
    """Step 3: page-major storage backends cannot read a layer_first host pool. The IO backend
    is never changed here (R2 is not re-applied): kernel -> page_first, direct ->
    page_first_direct."""
    if not hicache_normalisation_applies(args):
        return []
    backend = args.hicache_storage_backend
    if backend not in PAGE_MAJOR_STORAGE_BACKENDS or args.hicache_mem_layout != "layer_first":
        return []
    io = args.hicache_io_backend
    new_layout = "page_first_direct" if io == "direct" else "page_first"
    return change(args, "hicache_mem_layout", new_layout, "hicache.storage_layout",
                  storage_layout_warning(backend, new_layout, io), warning=True)


def ratio_default(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                  env: dict) -> list[Resolution]:
    """Step 4: a non-decode HiCache server needs a host pool size. A decode server keeps the
    ratio unset here: step 5 picks it once the retraction backup is known."""
    if not args.enable_hierarchical_cache or args.disaggregation_mode == "decode":
        return []
    out: list[Resolution] = []
    if args.hicache_ratio is None:
        buffer_only = args.hicache_host_memory_mode == "buffer_only"
        ratio = DEFAULT_BUFFER_ONLY_RATIO if buffer_only else DEFAULT_HICACHE_RATIO
        size_note = (f" (unused: --hicache-size {args.hicache_size} GB takes precedence)"
                     if args.hicache_size > 0 else "")
        out = change(args, "hicache_ratio", ratio, "hicache.ratio_default",
                     f"--hicache-ratio unset: default {ratio} for a "
                     f"{'buffer_only' if buffer_only else 'cache'}-mode HiCache server"
                     f"{size_note}")
    ratio = out[0].new if out else args.hicache_ratio
    if (ratio is None or ratio <= 0) and args.hicache_size <= 0:
        raise ValueError("--enable-hierarchical-cache requires a host pool size: set "
                         "--hicache-ratio or --hicache-size")
    return out
