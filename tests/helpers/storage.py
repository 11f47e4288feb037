"""Shared pieces of the HiCache L3 storage tests (tests/kv/test_storage_*.py): small host pools
in any layout, reproducible random flat pages, storage configs, and child processes that
write or read a store as another server would.

Run as `python -m helpers.storage <role> <json args>` (cwd tests/) for the child side."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from kvstrata.kv.host_pool import HostKVPool
from kvstrata.kv.layouts import KVGeometry
from kvstrata.kv.storage import StorageConfig, StorageNamespace, create_storage_backend

# odd sizes so that a transposed layout cannot pass by accident: page = 2*3*5*3*8*4 B = 2880 B
GEOM = KVGeometry(num_layers=3, num_kv_heads=3, head_dim=8, page_size=5, dtype=torch.float32)
NAMESPACE = StorageNamespace("tiny-model", "float32", "p5:k3x3x8,v3x3x8")
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS_DIR)


def make_pool(layout: str, num_pages: int = 24, geom: KVGeometry = GEOM) -> HostKVPool:
    return HostKVPool(geom, num_pages, layout, check_memory=False)


def random_flat(num_pages: int, seed: int, geom: KVGeometry = GEOM) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((num_pages, geom.page_numel), generator=gen).to(geom.dtype)


def page_keys(num_pages: int, tag: str = "k") -> list[str]:
    """Distinct 64-hex keys (the backends do not care how keys were made)."""
    import hashlib
    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(num_pages)]


def make_backend(name: str, pool: HostKVPool, extra: dict | None = None,
                 namespace: StorageNamespace = NAMESPACE):
    config = StorageConfig(namespace, pool.geom.bytes_per_page, dict(extra or {}))
    return create_storage_backend(name, config, pool)


def spawn_child(role: str, **args) -> subprocess.Popen:
    """A child process running `child_main(role, args)`; it prints `ready` when it is done
    with its work and exits when its stdin closes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS_DIR]), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "helpers.storage", role, json.dumps(args)],
                            cwd=TESTS_DIR, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(child: subprocess.Popen, timeout: float = 60.0) -> str:
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(child.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise AssertionError(f"child did not get ready in {timeout}s")
    line = child.stdout.readline().strip()
    if not line.startswith("ready"):
        child.kill()
        raise AssertionError(f"child failed: {line!r} {child.stderr.read()[-3000:]}")
    return line


def stop_child(child: subprocess.Popen) -> None:
    try:
        child.stdin.close()
        child.wait(timeout=20)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def child_main(role: str, args: dict) -> None:
    torch.set_num_threads(1)
    if role == "keys":  # page keys of fixed token ids, for the cross-process stability test
        from kvstrata.cache.page_keys import chain_page_keys
        print("ready " + json.dumps(chain_page_keys(args["tokens"], args["page_size"])),
              flush=True)
        sys.stdin.read()
        return
    # role "writer": store `num_pages` random flat pages (seed) under page_keys(tag), then
    # stay alive (holding its segment / its Mooncake segment) until stdin closes.
    pool = make_pool(args.get("layout", "page_first"), args["num_pages"])
    ids = list(range(1, args["num_pages"] + 1))
    pool.set_flat_pages(ids, random_flat(args["num_pages"], args["seed"]))
    backend = make_backend(args["backend"], pool, args["extra"])
    ok = backend.batch_set(page_keys(args["num_pages"], args["tag"]), ids)
    if hasattr(backend, "flush_index") and args.get("flush", True):
        backend.flush_index()
    print(f"ready {sum(ok)}", flush=True)
    sys.stdin.read()
    backend.close()


if __name__ == "__main__":
    child_main(sys.argv[1], json.loads(sys.argv[2]))
