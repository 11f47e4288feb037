"""Transfer-rate measurement of a PD backend against a raw loopback socket copy of the same
bytes, in the same run (the ratio is what to compare across machines; this box is shared,
see machine-facts.md). For benchmarks/ and by hand:

    python -m kvstrata.bench.transfer_rate --backend tcp --pages 128

Default geometry: SmolLM2-135M's KV (30 layers -> 60 sections, 3 KV heads x 64 dims, fp32)
with 16-token pages: 12 KiB per (page, section). Destination pages are shuffled, as a
decode server's free pages would be.
"""
from __future__ import annotations

import argparse
import json
import socket
import threading
import time

import torch

from kvstrata.bench.ports import free_port
from kvstrata.protocol.disagg import KVPoll, PDMetadata
from kvstrata.transfer.disagg.registry import create_manager


def _loopback_seconds(payload: memoryview) -> float:
    """Seconds to push `payload` through one 127.0.0.1 TCP connection into a preallocated
    buffer (the floor any socket-based backend pays)."""
    sink = bytearray(len(payload))
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def receive():
        conn, _ = server.accept()
        view, got = memoryview(sink), 0
        while got < len(sink):
            got += conn.recv_into(view[got:], min(1 << 22, len(sink) - got))
        conn.close()
        done.set()

    reader = threading.Thread(target=receive, daemon=True)
    reader.start()
    client = socket.create_connection(server.getsockname())
    start = time.perf_counter()
    client.sendall(payload)
    done.wait()
    seconds = time.perf_counter() - start
    client.close()
    server.close()
    reader.join()
    return seconds


def measure_transfer_rate(backend: str = "tcp", num_pages: int = 128, sections: int = 60,
                          page_bytes: int = 12288, pages_per_send: int = 32,
                          repeats: int = 3, seed: int = 0) -> dict:
    """Best-of-`repeats` GB/s of one room moving `num_pages` pages from a prefill manager to
    a decode manager in this process (send() calls of `pages_per_send` pages; time from
    the first send() to the decode side's SUCCESS), and of the loopback socket baseline."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (sections, num_pages + 1, page_bytes), dtype=torch.uint8,
                        generator=gen)
    dst = torch.zeros_like(src)
    port = free_port()
    common = dict(host="127.0.0.1", num_metadata_slots=4, page_size=16, kv_dtype="float32")
    prefill = create_manager(backend, "prefill", [src], bootstrap_port=port, **common)
    decode = create_manager(backend, "decode", [dst], bootstrap_port=0, **common)
    total = num_pages * sections * page_bytes
    best = float("inf")
    try:
        for room in range(1, repeats + 1):
            src_pages = list(range(1, num_pages + 1))
            dst_pages = [src_pages[i] for i in torch.randperm(num_pages, generator=gen)]
            sender = prefill.create_sender("127.0.0.1", port, room)
            receiver = decode.create_receiver("127.0.0.1", port, room)
            _wait(lambda: receiver.poll() == KVPoll.WAITING_FOR_INPUT)
            receiver.init(dst_pages, 0)
            _wait(lambda: sender.poll() == KVPoll.WAITING_FOR_INPUT)
            sender.init(num_pages, 0)
            start = time.perf_counter()
            for i in range(0, num_pages, pages_per_send):
                last = i + pages_per_send >= num_pages
                sender.send(src_pages[i:i + pages_per_send], last,
                            PDMetadata(room, 0) if last else None)
            _wait(lambda: receiver.poll() in (KVPoll.SUCCESS, KVPoll.FAILED))
            best = min(best, time.perf_counter() - start)
            if receiver.poll() != KVPoll.SUCCESS:
                raise RuntimeError(f"transfer failed: {receiver.failure_reason}")
            if not torch.equal(dst[:, dst_pages], src[:, src_pages]):
                raise RuntimeError("transferred bytes differ from the source")
    finally:
        prefill.close()
        decode.close()
    payload = memoryview(src[:, 1:].contiguous().numpy()).cast("B")
    loop = min(_loopback_seconds(payload) for _ in range(repeats))
    return {"backend": backend, "bytes": total, "pages": num_pages, "sections": sections,
            "page_bytes": page_bytes, "gbps": total / best / 1e9,
            "loopback_socket_gbps": total / loop / 1e9, "ratio_to_loopback": loop / best}


def _wait(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("transfer did not progress")
        time.sleep(0.0005)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="tcp", choices=["tcp", "mooncake"])
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--sections", type=int, default=60)
    ap.add_argument("--page-bytes", type=int, default=12288)
    ap.add_argument("--pages-per-send", type=int, default=32)
    args = ap.parse_args()
    print(json.dumps(measure_transfer_rate(args.backend, args.pages, args.sections,
                                           args.page_bytes, args.pages_per_send), indent=1))


if __name__ == "__main__":
    main()
