"""HiCache L3 storage put/get bandwidth per backend, against raw sequential file I/O.

For each page geometry, stores `--total-mib` of random KV pages from a page_first host pool
(batch_set, `--batch` pages per call, as the backup thread does) and reads them back into a
layer_first pool (batch_get), per backend (memory, file, mooncake when importable). Beside
every repetition, in the same run, the same bytes are written to one new file with large
sequential os.write calls and read back with readinto (the raw baseline). `ratio` = backend
GB/s / raw GB/s of the same repetition, median over repetitions; `gbps` the best.

Warm, not cold: the page cache cannot be dropped without root, so reads (raw and file
backend) come from RAM just after the writes, and writes end in the page cache (no fsync).
The file backend also checksums every page both ways (two 64-bit sums, file_records.py);
`crc32_gbps` is zlib crc32's speed on the same bytes, the checksum it replaced. The Mooncake Store runs on this machine over TCP, with a master the
benchmark starts and stops.

  python benchmarks/bench_storage.py --out benchmarks/results/bench_storage.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402
from kvstrata.kv.host_pool import HostKVPool  # noqa: E402
from kvstrata.kv.layouts import KVGeometry  # noqa: E402
from kvstrata.kv.storage import (StorageConfig, StorageNamespace,  # noqa: E402
                                 create_storage_backend)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MiB = 1 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # SmolLM2-135M geometry: 30 layers, 3 kv heads, head dim 64; page 16 = 1.41 MiB in fp32
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-sizes", type=int, nargs="+", default=[16, 1],
                   help="tokens per page; one row set per page size")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--total-mib", type=int, default=256, help="bytes moved per repetition")
    p.add_argument("--batch", type=int, default=128, help="pages per batch_set/batch_get")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--backends", nargs="+", default=["memory", "file", "mooncake"])
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (on a loaded 2-core box more threads made the "
                        "flat-page copies and payload sums ~7x slower)")
    p.add_argument("--dir", default=None, help="where files go (default: a temp dir)")
    p.add_argument("--out", default="benchmarks/results/bench_storage.json")
    add_quiet_arg(p)
    return p.parse_args(argv)


def raw_file_io(path: str, data: memoryview, chunk: int, out: bytearray) -> tuple[float, float]:
    """Seconds to write `data` to a new file in `chunk`-byte writes, and to read it back."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for off in range(0, len(data), chunk):
        os.write(fd, data[off:off + chunk])
    os.close(fd)
    mid = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        view, got = memoryview(out), 0
        while got < len(out):
            got += f.readinto(view[got:got + chunk])
    end = time.perf_counter()
    os.unlink(path)
    return mid - start, end - mid


def in_batches(n: int, batch: int):
    for start in range(0, n, batch):
        yield start, min(n, start + batch)


def time_puts(store, keys, ids, batch) -> float:
    start = time.perf_counter()
    for a, b in in_batches(len(keys), batch):
        if not all(store.batch_set(keys[a:b], ids[a:b])):
            raise RuntimeError(f"{type(store).__name__}: batch_set failed")
    return time.perf_counter() - start


def time_gets(store, keys, ids, batch) -> tuple[float, bool]:
    """(seconds, every page was a hit)."""
    start = time.perf_counter()
    hits = sum(sum(store.batch_get(keys[a:b], ids[a:b])) for a, b in in_batches(len(keys), batch))
    return time.perf_counter() - start, hits == len(keys)


class Backends:
    """A writer backend over the page_first pool; readers over the layer_first pool are
    opened after the writes (a restarted server: the file backend finds the new records when
    it opens). Mooncake uses its writer client for reads too: closing a client costs ~2 s."""

    def __init__(self, name, geom, writer_pool, reader_pool, workdir, total_bytes, master):
        self.name, self.reader_pool = name, reader_pool
        ns = StorageNamespace("bench", str(geom.dtype).split(".")[-1], f"p{geom.page_size}")
        extra = {"memory": {"memory_store_id": workdir},
                 "file": {"file_path": workdir, "max_bytes": 4 * total_bytes + (1 << 30)},
                 "mooncake": {"master_server_address": master.address if master else "",
                              "global_segment_size": 2 * total_bytes + 64 * MiB}}[name]
        self.config = StorageConfig(ns, geom.bytes_per_page, extra)
        self.writer = create_storage_backend(name, self.config, writer_pool)
        self.readers = []

    def reader(self):
        if self.name == "mooncake":
            self.writer.host_pool = self.reader_pool
            return self.writer
        self.readers.append(create_storage_backend(self.name, self.config, self.reader_pool))
        return self.readers[-1]

    def next_rep(self, writer_pool):
        self.writer.host_pool = writer_pool
        self.writer.clear()

    def close(self):
        for store in [self.writer, *self.readers]:
            store.clear()
            store.close()


def bench_page_size(args, page_size, backends, workdir, master) -> list[dict]:
    geom = KVGeometry(args.layers, args.kv_heads, args.head_dim, page_size, DTYPES[args.dtype])
    n = max(1, args.total_mib * MiB // geom.bytes_per_page)
    writer = HostKVPool(geom, n, "page_first", check_memory=False)
    reader = HostKVPool(geom, n, "layer_first", check_memory=False)
    ids = list(range(1, n + 1))
    writer.set_flat_pages(ids, torch.randn(n, geom.page_numel).to(geom.dtype))
    flat = writer.get_flat_pages(ids).view(torch.uint8).reshape(-1).numpy()
    data, total = memoryview(flat), flat.nbytes
    out = bytearray(total)
    chunk = args.batch * geom.bytes_per_page
    start = time.perf_counter()
    zlib.crc32(data)
    crc_gbps = total / (time.perf_counter() - start) / 1e9
    rows = []
    for name in backends:
        stores = Backends(name, geom, writer, reader, workdir, total, master)
        try:
            put_t, get_t, raw_w, raw_r, put_ratio, get_ratio = [], [], [], [], [], []
            for rep in range(args.reps):
                stores.next_rep(writer)
                keys = [f"{rep:08d}{i:056x}" for i in range(n)]
                w, r = raw_file_io(os.path.join(workdir, "raw.bin"), data, chunk, out)
                reader.kv.zero_()
                p = time_puts(stores.writer, keys, ids, args.batch)
                g, all_hit = time_gets(stores.reader(), keys, ids, args.batch)
                if not all_hit or not torch.equal(reader.get_flat_pages(ids),
                                                  writer.get_flat_pages(ids)):
                    raise RuntimeError(f"{name}: pages did not round-trip exactly")
                put_t.append(p), get_t.append(g), raw_w.append(w), raw_r.append(r)
                put_ratio.append(w / p), get_ratio.append(r / g)
        finally:
            stores.close()
        for op, times, raw, ratios in (("put", put_t, raw_w, put_ratio),
                                       ("get", get_t, raw_r, get_ratio)):
            rows.append({"backend": name, "op": op, "page_size": page_size,
                         "page_bytes": geom.bytes_per_page, "pages": n,
                         "gbps": total / min(times) / 1e9, "raw_gbps": total / min(raw) / 1e9,
                         "ratio": statistics.median(ratios), "crc32_gbps": crc_gbps})
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    box = announce_load(args.require_quiet)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    backends = list(args.backends)
    master = None
    if "mooncake" in backends:
        try:
            import mooncake.store  # noqa: F401
            from kvstrata.kv.storage.mooncake_master import MooncakeMaster
            master = MooncakeMaster().start()
        except ImportError as e:
            print(f"skipping mooncake: {e}", file=sys.stderr)
            backends.remove("mooncake")
    workdir = tempfile.mkdtemp(prefix="kvstrata-bench-storage-", dir=args.dir)
    try:
        rows = []
        for page_size in args.page_sizes:
            rows += bench_page_size(args, page_size, backends, workdir, master)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if master is not None:
            master.stop()
    print(f"{'backend':9} {'op':4} {'page KiB':>9} {'pages':>6} {'GB/s':>7} "
          f"{'raw GB/s':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['backend']:9} {r['op']:4} {r['page_bytes'] / 1024:9.1f} {r['pages']:6d} "
              f"{r['gbps']:7.2f} {r['raw_gbps']:9.2f} {r['ratio']:6.2f}")
    print("crc32 alone: " + ", ".join(f"{r['page_bytes'] / 1024:.0f} KiB pages "
                                      f"{r['crc32_gbps']:.2f} GB/s" for r in rows
                                      if r["backend"] == rows[0]["backend"] and r["op"] == "put"))
    meta = dict(vars(args), box_load=box, torch=torch.__version__, warm_page_cache=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
