"""HiCache L3 through real servers: a restarted server on the same `file` store serves a long
shared prefix from storage (its metrics prove it) with the answer of the cold run.

Needs the `file` backend (kvstrata/kv/storage/file_store.py, from the storage branch): the
test is skipped until it is merged."""
from __future__ import annotations

import httpx
import pytest

from tests.e2e.server_utils import ServerProcess


def metric(text: str, name: str) -> float:
    lines = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
    assert lines, f"{name} not exported"
    return float(lines[0].split()[-1])


def test_restarted_server_serves_the_prefix_from_the_file_store(tiny_model_path, tmp_path):
    pytest.importorskip("kvstrata.kv.storage.file_store")
    args = ("--served-model-name", "tiny", "--page-size", "16", "--max-total-tokens", "1024",
            "--enable-hierarchical-cache", "--hicache-ratio", "2",
            "--hicache-storage-backend", "file",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", f'{{"file_path": "{tmp_path}"}}')
    prompt = " ".join(["the shared system prompt"] * 80)  # a few hundred tokens
    answers, metrics = [], []
    for _ in range(2):
        srv = ServerProcess(tiny_model_path, *args)
        try:
            r = httpx.post(srv.base_url + "/generate", timeout=60, json={
                "text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                    "ignore_eos": True}})
            r.raise_for_status()
            answers.append(r.json()["output_ids"])
            metrics.append(httpx.get(srv.base_url + "/metrics").text)
        finally:
            assert srv.stop() == 0  # SIGTERM: the backups finish before the exit
    assert answers[1] == answers[0]
    assert metric(metrics[0], "kvstrata:hicache_storage_hit_tokens_total") == 0
    hit = metric(metrics[1], "kvstrata:hicache_storage_hit_tokens_total")
    assert hit >= 256, f"the restarted server read only {hit} prompt tokens from storage"
    assert metric(metrics[1], "kvstrata:hicache_storage_bytes_read_total") > 0
