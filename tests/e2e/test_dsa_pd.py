"""PD disaggregation of the tiny DSA model with real processes and the tcp backend, between
different tensor-parallel sizes: a --tp-size 2 prefill and a --tp-size 1 decode (MLA's
latent KV is whole on every rank: the decode pulls from prefill rank 0 and tells rank 1 it
sends nothing, transfer/disagg/rank_map.py). The MLA latent + indexer-key pages cross
(prompts longer than one prefill chunk included), the decode server's greedy tokens equal
transformers, and the top-k seed arrives: for every seed position p, the latent row at the
decode server's local slot equals the prefill server's row at position p (both read through
/debug/dsa_seeds). This box is a CPU: the resolved gate passes the positions through
unchanged (the remapping platforms are covered in-process by
tests/correctness/test_dsa_pd_seed.py). Equal sizes: test_pd_mtp.py (tp 1) and
test_pd_tp.py (tp 2)."""
from __future__ import annotations

import httpx
import pytest

from helpers.compare import assert_tokens_match
from tests.e2e.server_utils import ServerProcess
from tests.conftest import hf_greedy_references
from tests.e2e.pd_servers import COMMON, PD_ENV, PDServers, assert_no_leak, serving

NEW_TOKENS = 8


class DSAPDServers(PDServers):
    """Token ids in and out; the tiny checkpoint has no tokenizer, so the servers borrow the
    e2e llama's (start-up loads one either way; ids below 300 decode to something)."""

    def __init__(self, model: str, tokenizer: str):
        self.tokenizer_args = ("--skip-tokenizer-init", "--tokenizer-path", tokenizer)
        super().__init__(model, "tcp", *self.tokenizer_args)

    def start_prefill(self, wait: bool = True) -> ServerProcess:
        return ServerProcess(self.model, *COMMON, *self.tokenizer_args,
                             "--disaggregation-mode", "prefill",
                             "--disaggregation-transfer-backend", "tcp",
                             "--disaggregation-bootstrap-port", str(self.bootstrap_port),
                             "--max-total-tokens", "4096", "--tp-size", "2", env=PD_ENV,
                             wait=wait)


def seed_records(srv) -> list:
    return httpx.get(srv.base_url + "/debug/dsa_seeds", timeout=10).json()["records"]


PROMPTS = (7, 6, 3)  # 70 tokens (two prefill chunks of 64), 45, 16


@pytest.fixture(scope="module")
def dsa_pd(tiny_dsa_4_heads, tiny_model_path):
    with serving(DSAPDServers(tiny_dsa_4_heads, tiny_model_path)) as servers:
        yield servers


def test_dsa_pd_tcp_output_and_seed_from_a_tp2_prefill(dsa_pd, tiny_dsa_4_heads, tiny_prompts):
    references = dict(zip(PROMPTS, hf_greedy_references(
        tiny_dsa_4_heads, [tiny_prompts[i] for i in PROMPTS])))
    info = httpx.get(dsa_pd.decode.base_url + "/server_info", timeout=10).json()
    assert info["kv_plan"]["pool_kind"] == "mla"
    assert info["dsa_remap_pd_seed_to_local_slots"] is False  # CPU: positions pass through
    route = f"http://127.0.0.1:{dsa_pd.bootstrap_port}/route"
    assert httpx.get(route, params=dict.fromkeys(("prefill_dp_rank", "prefill_cp_rank",
                                                  "target_tp_rank", "target_pp_rank"), -1),
                     timeout=5).json()["attn_tp_size"] == 2
    for i in PROMPTS:
        prompt = tiny_prompts[i]
        prefill, decode = dsa_pd.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert prefill.status_code == 200, prefill.text
        assert decode.status_code == 200, decode.text
        ref_tokens, ref_logits = references[i]
        assert_tokens_match(decode.json()["output_ids"], ref_tokens[:NEW_TOKENS], ref_logits,
                            label=f"dsa pd prompt {i}")
        sent, received = seed_records(dsa_pd.prefill)[-1], seed_records(dsa_pd.decode)[-1]
        assert received["positions"] == sent["positions"]
        assert sum(p >= 0 for p in sent["positions"]) == min(len(prompt), 8)
        assert received["remapped"] is False and received["seed"] == sent["positions"]
        assert received["latent"] == sent["latent"]
    for srv in (dsa_pd.prefill, dsa_pd.decode):
        assert_no_leak(srv)
