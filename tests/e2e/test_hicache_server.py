"""HiCache L2 through the server: a device pool too small for the conversations, pages
demoted to the host pool and loaded back, answers unchanged, stats on /metrics, no leak."""
from __future__ import annotations

import httpx

from tests.e2e.pd_servers import wait_drained
from tests.e2e.server_utils import ServerProcess


def test_hicache_server_loads_back_and_reports(tiny_model_path):
    srv = ServerProcess(tiny_model_path, "--served-model-name", "tiny", "--page-size", "16",
                        "--max-total-tokens", "512", "--enable-hierarchical-cache",
                        "--hicache-ratio", "8", "--hicache-write-policy", "write_back")
    try:
        prompts = [" ".join([f"conversation {i}"] * 60) for i in range(6)]

        def ask(text):
            r = httpx.post(srv.base_url + "/generate", timeout=60, json={
                "text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                  "ignore_eos": True}})
            r.raise_for_status()
            return r.json()

        first = [ask(p)["output_ids"] for p in prompts]  # 6 x ~180 tokens > 512-token pool
        again = [ask(p) for p in prompts[:3]]
        assert [a["output_ids"] for a in again] == first[:3]
        assert all(a["meta_info"]["cached_tokens"] > 0 for a in again)
        metrics = httpx.get(srv.base_url + "/metrics").text
        host_hits = [line for line in metrics.splitlines()
                     if line.startswith('kvstrata:hicache{') and 'stat="host_hit_tokens"' in line]
        assert host_hits and float(host_hits[0].split()[-1]) > 0
        kv = wait_drained(srv)  # the last answer's async host write may still lock its node
        assert kv["ok"] and kv["num_used_tokens"] == 0, kv
    finally:
        srv.stop()
