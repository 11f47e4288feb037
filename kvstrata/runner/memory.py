"""How much memory the KV pool may take when the user gives no size."""
from __future__ import annotations

import os

import torch

CPU_KV_FRACTION = 0.25      # of the RAM available now
CPU_KV_CAP_BYTES = 4 << 30  # a CPU box rarely benefits from more, and RAM is shared
GPU_KV_FRACTION = 0.85      # of the device memory still free after the weights are loaded


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget_from_fraction(device: torch.device, fraction: float, weights_bytes: int) -> int:
    """--mem-fraction-static: weights + KV pool may take `fraction` of the device's memory
    (on CPU: of the RAM available before the weights were loaded)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * fraction) - (total - free)
    else:
        budget = int((available_ram_bytes() + weights_bytes) * fraction) - weights_bytes
    if budget <= 0:
        raise ValueError(f"--mem-fraction-static {fraction} leaves no memory for the KV cache "
                         f"after {weights_bytes / 2**30:.2f} GiB of weights; raise it")
    return budget


def default_kv_budget_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * GPU_KV_FRACTION)
    return int(min(available_ram_bytes() * CPU_KV_FRACTION, CPU_KV_CAP_BYTES))
