"""Which hardware we run on: one `Platform` value, detected once from torch and cached.

Every platform-dependent branch in kvstrata goes through `current_platform()` or the
`is_cuda()` / `is_hip()` / ... predicates below, so such branches are grep-able and tests can
simulate any platform with `simulate_platform(kind)` — nothing else may look at
`torch.version.hip` or `torch.cuda.is_available()` directly.

The predicates read the current platform on every call (detection itself is cached), unlike
SGLang's `lru_cache`d helpers that tests had to patch in each importing module.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator

KINDS = ("cuda", "hip", "npu", "xpu", "mps", "cpu")

# The torch device type used for each platform kind. ROCm builds of torch expose the GPU as
# "cuda" devices, so hip maps to "cuda" too.
DEVICE_TYPES = {"cuda": "cuda", "hip": "cuda", "npu": "npu", "xpu": "xpu", "mps": "mps",
                "cpu": "cpu"}


@dataclass(frozen=True)
class Platform:
    kind: str
    device_name: str = ""
    # Free-form facts (compute capability, torch build versions, ...) for logs and
    # `/server_info`; decisions should use `kind`, not these.
    capabilities: dict = field(default_factory=dict, compare=False, hash=False)
    simulated: bool = False
    # The host CPU's feature flags (/proc/cpuinfo: avx2, avx512_bf16, amx_bf16, ...): the CPU
    # dtype rule (config/rules/platform_defaults.py) reads them. Empty when simulated unless
    # given, so resolution tests do not depend on the machine they run on.
    cpu_flags: frozenset = field(default_factory=frozenset, compare=False, hash=False)
    # The intra-op threads torch runs CPU work on here (torch.get_num_threads(); 0: unknown,
    # as when simulated unless given): the same dtype rule bounds a row by it.
    cpu_threads: int = field(default=0, compare=False, hash=False)
    # (dtype, reason) that serve / LLM() measured for --dtype auto where the dtype table has
    # no row for this CPU (runner/cpu/dtype_probe.py); None: not measured.
    cpu_dtype_measured: tuple[str, str] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown platform kind {self.kind!r}; expected one of "
                             f"{', '.join(KINDS)}")

    @property
    def device_type(self) -> str:
        return DEVICE_TYPES[self.kind]

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def is_hip(self) -> bool:
        return self.kind == "hip"

    @property
    def is_npu(self) -> bool:
        return self.kind == "npu"

    @property
    def is_xpu(self) -> bool:
        return self.kind == "xpu"

    @property
    def is_mps(self) -> bool:
        return self.kind == "mps"

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    @property
    def is_cuda_alike(self) -> bool:
        # CUDA and ROCm share the torch.cuda API and (in SGLang) the HiCache JIT kernels.
        return self.kind in ("cuda", "hip")

    def describe(self) -> str:
        name = f" ({self.device_name})" if self.device_name else ""
        return f"{self.kind}{name}{' [simulated]' if self.simulated else ''}"


def simulated(kind: str, device_name: str = "", cpu_flags=(), cpu_threads: int = 0) -> Platform:
    """A Platform value for `kind` without touching torch (tests, `config --explain`)."""
    return Platform(kind=kind, device_name=device_name, simulated=True,
                    cpu_flags=frozenset(cpu_flags), cpu_threads=cpu_threads)


# Either lets int8 GEMMs accumulate u8*s8 products in int32 (no int16 saturation): the
# --quantization w8a8_int8 layer and the --dtype auto rule for it both ask (runner/, config/).
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})


def read_cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The first CPU's model name ("unknown" if unreadable)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return next((line.partition(":")[2].strip() for line in fh
                         if line.partition(":")[0].strip() == "model name"), "unknown")
    except OSError:
        return "unknown"


def read_cpu_flags(path: str = "/proc/cpuinfo") -> frozenset:
    """The first CPU's feature flags (x86 `flags`, Arm `Features`); empty if unreadable."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def detect_platform() -> Platform:
    """Ask torch which hardware is present. Uncached; use `current_platform()`."""
    import torch

    caps: dict = {"torch": torch.__version__}
    flags = read_cpu_flags()
    host = {"cpu_flags": flags, "cpu_threads": torch.get_num_threads()}
    # A ROCm build sets torch.version.hip and reports its GPUs through torch.cuda; check it
    # before CUDA because torch.cuda.is_available() is also True there. A ROCm build without a
    # visible GPU is a CPU box for our purposes.
    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        caps["hip"] = torch.version.hip
        return Platform("hip", torch.cuda.get_device_name(0), caps, **host)
    if torch.cuda.is_available() and getattr(torch.version, "cuda", None):
        caps["cuda"] = torch.version.cuda
        caps["compute_capability"] = torch.cuda.get_device_capability(0)
        return Platform("cuda", torch.cuda.get_device_name(0), caps, **host)
    npu = getattr(torch, "npu", None)  # present only once torch_npu has been imported
    if npu is not None and npu.is_available():
        return Platform("npu", "Ascend NPU", caps, **host)
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return Platform("xpu", xpu.get_device_name(0), caps, **host)
    mps = getattr(getattr(torch, "backends", None), "mps", None)
    if mps is not None and mps.is_available():
        return Platform("mps", "Apple MPS", caps, **host)
    import platform as _stdlib_platform
    return Platform("cpu", _stdlib_platform.processor() or _stdlib_platform.machine(), caps, **host)


_lock = threading.Lock()
_detected: Platform | None = None
_simulated_stack: list[Platform] = []


def current_platform() -> Platform:
    """The simulated platform if a `simulate_platform` block is active, else the detected one."""
    if _simulated_stack:
        return _simulated_stack[-1]
    return detected_platform()


def detected_platform() -> Platform:
    """The real hardware, ignoring any simulation (serve uses it to refuse a --platform that
    does not match the machine)."""
    global _detected
    if _detected is None:
        with _lock:
            if _detected is None:
                _detected = detect_platform()
    return _detected


@contextlib.contextmanager
def simulate_platform(kind: str | Platform) -> Iterator[Platform]:
    """Within the block, every predicate answers as if running on `kind`. Nestable."""
    plat = kind if isinstance(kind, Platform) else simulated(kind)
    _simulated_stack.append(plat)
    try:
        yield plat
    finally:
        _simulated_stack.remove(plat)


def is_cuda() -> bool:
    return current_platform().is_cuda


def is_hip() -> bool:
    return current_platform().is_hip


def is_cuda_alike() -> bool:
    return current_platform().is_cuda_alike


def is_npu() -> bool:
    return current_platform().is_npu


def is_xpu() -> bool:
    return current_platform().is_xpu


def is_mps() -> bool:
    return current_platform().is_mps


def is_cpu() -> bool:
    return current_platform().is_cpu
