"""HiCache L3 through real servers: a restarted server on the same `file` store, and a second
server on the same Mooncake Store, serve a long shared prefix from storage (their metrics
prove it) with the answer of the cold run."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.e2e.server_utils import ServerProcess


def metric(text: str, name: str) -> float:
    lines = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
    assert lines, f"{name} not exported"
    return float(lines[0].split()[-1])


PROMPT = " ".join(["the shared system prompt"] * 80)  # a few hundred tokens


def generate(srv: ServerProcess, **salt) -> list[int]:
    r = httpx.post(srv.base_url + "/generate", timeout=60, json={
        "text": PROMPT, **salt, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                    "ignore_eos": True}})
    r.raise_for_status()
    return r.json()["output_ids"]


def test_restarted_server_serves_the_prefix_from_the_file_store(tiny_model_path, tmp_path):
    pytest.importorskip("kvstrata.kv.storage.file_store")
    args = ("--served-model-name", "tiny", "--page-size", "16", "--max-total-tokens", "1024",
            "--enable-hierarchical-cache", "--hicache-ratio", "2",
            "--hicache-storage-backend", "file",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", f'{{"file_path": "{tmp_path}"}}')
    hits = "kvstrata:hicache_storage_hit_tokens_total"
    answers, metrics, salted = [], [], []
    for life in range(2):
        srv = ServerProcess(tiny_model_path, *args)
        try:
            answers.append(generate(srv))
            metrics.append(httpx.get(srv.base_url + "/metrics").text)
            # A cache salt keys its pages apart in storage too (cache/page_keys.py): the
            # restarted server reads tenant-a's pages for tenant-a only.
            for tenant in ("tenant-b", "tenant-a") if life else ("tenant-a",):
                before = metric(httpx.get(srv.base_url + "/metrics").text, hits)
                assert generate(srv, cache_salt=tenant) == answers[0]
                salted.append(metric(httpx.get(srv.base_url + "/metrics").text, hits) - before)
        finally:
            assert srv.stop() == 0  # SIGTERM: the backups finish before the exit
    assert answers[1] == answers[0]
    assert metric(metrics[0], hits) == 0
    hit = metric(metrics[1], hits)
    assert hit >= 256, f"the restarted server read only {hit} prompt tokens from storage"
    assert metric(metrics[1], "kvstrata:hicache_storage_bytes_read_total") > 0
    assert salted[0] == 0 and salted[1] == 0 and salted[2] >= 256, salted


def test_second_server_hits_pages_the_first_wrote_to_mooncake(tiny_model_path):
    """Two live servers, one Mooncake Store (a master of the test's own): the second serves
    the prefix from the pages the first backed up. The first stays up throughout: a Mooncake
    client's contributed memory leaves the store with it."""
    pytest.importorskip("mooncake.store", exc_type=ImportError)
    from kvstrata.kv.storage.mooncake_master import MooncakeMaster
    with MooncakeMaster() as master:
        extra = json.dumps({"master_server_address": master.address, "protocol": "tcp",
                            "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1",
                            "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20})
        args = ("--served-model-name", "tiny", "--page-size", "16", "--max-total-tokens",
                "1024", "--enable-hierarchical-cache", "--hicache-ratio", "2",
                "--hicache-mem-layout", "page_first", "--hicache-storage-backend", "mooncake",
                "--hicache-storage-prefetch-policy", "wait_complete",
                "--hicache-storage-backend-extra-config", extra)
        first = ServerProcess(tiny_model_path, *args)
        second = None
        try:
            cold = generate(first)
            deadline = time.monotonic() + 30
            while metric(httpx.get(first.base_url + "/metrics").text,
                         "kvstrata:hicache_storage_backup_pages_total") < 16:
                assert time.monotonic() < deadline, "the first server's backups never ended"
                time.sleep(0.2)
            second = ServerProcess(tiny_model_path, *args)
            assert generate(second) == cold
            text = httpx.get(second.base_url + "/metrics").text
            hit = metric(text, "kvstrata:hicache_storage_hit_tokens_total")
            assert hit >= 256, f"the second server read only {hit} prompt tokens from storage"
        finally:
            for srv in (second, first):
                if srv is not None:
                    assert srv.stop() == 0
