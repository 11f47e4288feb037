"""PD + NEXTN with real processes: the tiny DSA model with an MTP layer, both servers run
`--speculative-algorithm NEXTN`; the prefill's draft KV, first top-k, hidden state and DSA
seed cross (tcp at page size 16, mooncake at page size 1), the decode server's first draft
round starts from them, and its greedy tokens equal transformers' (prompts longer than a
prefill chunk, and prefix hits on the prefill server, included). Through sglang-router too.
The counters say the seed was used (this box is a CPU: positions pass through)."""
from __future__ import annotations

import threading

import httpx
import pytest

from helpers.compare import assert_tokens_match
from tests.e2e.pd_servers import (COMMON, PD_ENV, PDServers, assert_no_leak,
                                   backend_available, router_generate, serving)
from tests.e2e.server_utils import ServerProcess

NEW_TOKENS = 12
SPEC = ("--speculative-algorithm", "NEXTN", "--speculative-disable-by-batch-size", "64")


class MTPPDServers(PDServers):
    def __init__(self, model: str, tokenizer: str, backend: str, page_size: int,
                 *decode_only: str):
        self.extra = ("--skip-tokenizer-init", "--tokenizer-path", tokenizer, "--page-size",
                      str(page_size), *SPEC)
        super().__init__(model, backend, *self.extra, *decode_only)

    def start_prefill(self, wait: bool = True, port: int | None = None) -> ServerProcess:
        return ServerProcess(self.model, *COMMON, *self.extra,
                             "--disaggregation-mode", "prefill",
                             "--disaggregation-transfer-backend", self.backend,
                             "--disaggregation-bootstrap-port", str(self.bootstrap_port),
                             "--max-total-tokens", "4096", env=PD_ENV, wait=wait, port=port)


@pytest.fixture(scope="module")
def mtp_pd(tiny_dsa_mtp_checkpoint, tiny_model_path):
    """tcp at page size 16 (mooncake at page size 1: the pressured pair below)."""
    with serving(MTPPDServers(tiny_dsa_mtp_checkpoint, tiny_model_path, "tcp", 16)) as servers:
        yield servers


def _load(srv) -> dict:
    return httpx.get(srv.base_url + "/get_load", timeout=10).json()


def test_pd_nextn_equals_transformers(mtp_pd, tiny_prompts, tiny_dsa_references):
    before = _load(mtp_pd.decode)
    for i in (7, 6, 3, 7):  # 70 tokens (two prefill chunks), 45, 16, then 70 again: a hit
        prefill, decode = mtp_pd.generate(tiny_prompts[i], max_new_tokens=NEW_TOKENS,
                                          ignore_eos=True)
        assert prefill.status_code == 200, prefill.text
        assert decode.status_code == 200, decode.text
        ref_tokens, ref_logits = tiny_dsa_references[i]
        out = decode.json()
        assert_tokens_match(out["output_ids"], ref_tokens[:NEW_TOKENS], ref_logits,
                            label=f"pd nextn prompt {i}")
        assert out["meta_info"]["spec_verify_ct"] >= 1
    assert prefill.json()["meta_info"]["cached_tokens"] > 0  # the prefill's prefix hit
    load = _load(mtp_pd.decode)
    assert load["spec_dsa_seed_used"] - before.get("spec_dsa_seed_used", 0) == 4, load
    metrics = httpx.get(mtp_pd.decode.base_url + "/metrics", timeout=10).text
    assert 'kvstrata:spec_dsa_seed_total{model_name="tiny",outcome="used"}' in metrics
    for srv in (mtp_pd.prefill, mtp_pd.decode):
        assert_no_leak(srv)


def test_pd_nextn_through_sglang_router(mtp_pd, tiny_prompts, tiny_dsa_references):
    out = router_generate(mtp_pd, tiny_prompts[6], NEW_TOKENS)
    ref_tokens, ref_logits = tiny_dsa_references[6]
    assert_tokens_match(out, ref_tokens[:NEW_TOKENS], ref_logits, label="router")


# A soak (KVSTRATA_SOAK=1): NEXTN over PD is test_pd_nextn_equals_transformers, decode
# retraction with speculation test_pd_retraction.py's standalone case.
@pytest.mark.soak
def test_pd_nextn_under_decode_retraction(tiny_dsa_mtp_checkpoint, tiny_model_path,
                                         tiny_prompts, tiny_dsa_references):
    """A decode pool far smaller than the batch's KV, over mooncake at page size 1: requests
    are retracted with a KV backup and restored (their draft state is not resent: they
    extend again); every answer equals transformers; both pools drain whole; then aborts on
    both sides."""
    backend_available("mooncake")
    new = 30
    with serving(MTPPDServers(tiny_dsa_mtp_checkpoint, tiny_model_path, "mooncake", 1,
                              "--max-total-tokens", "160", "--num-reserved-decode-tokens",
                              "4")) as pd:
        out: dict = {}

        def one(i: int) -> None:
            out[i] = pd.generate(tiny_prompts[i], max_new_tokens=new, timeout=180,
                                 ignore_eos=True)[1]
        threads = [threading.Thread(target=one, args=(i,)) for i in range(2, 8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, r in out.items():
            assert r.status_code == 200, r.text
            ref_tokens, ref_logits = tiny_dsa_references[i]
            assert_tokens_match(r.json()["output_ids"], ref_tokens[:new], ref_logits,
                                label=f"retracted pd nextn prompt {i}")
        assert _load(pd.decode)["decode_retractions_total"] > 0
        for srv in (pd.prefill, pd.decode):
            assert_no_leak(srv)
        _abort_on_both_sides(pd, tiny_prompts)


def _abort_on_both_sides(pd, prompts) -> None:
    """Long requests aborted while they decode (on the decode server) and while they prefill
    or wait to send (on the prefill server): every answer ends, both pools drain whole."""
    import time

    statuses: dict[str, int] = {}

    def one(i: int) -> None:
        body = {"input_ids": prompts[i], "rid": f"m{i}", "sampling_params": {
            "max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}, **pd.body()}
        threading.Thread(target=lambda: httpx.post(pd.prefill.base_url + "/generate",
                                                   json=body, timeout=120)).start()
        statuses[body["rid"]] = httpx.post(pd.decode.base_url + "/generate", json=body,
                                           timeout=120).status_code
    threads = [threading.Thread(target=one, args=(i,)) for i in range(2, 8)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    for i in (6, 7):  # prefill side, likely before their transfer ended
        httpx.post(pd.prefill.base_url + "/abort_request", json={"rid": f"m{i}"}, timeout=30)
    time.sleep(1.0)
    for i in range(2, 8):
        httpx.post(pd.decode.base_url + "/abort_request", json={"rid": f"m{i}"}, timeout=30)
    for t in threads:
        t.join()
    assert len(statuses) == 6, statuses
    for srv in (pd.prefill, pd.decode):
        assert_no_leak(srv)
