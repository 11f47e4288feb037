"""A real server with --quantization w8a8_int8: /server_info says what ran (the scheme from
the scheduler process's runner, the kernel, the smoothing) and requests are served."""
from __future__ import annotations

import httpx

from tests.e2e.server_utils import ServerProcess


def test_w8a8_server_reports_the_kernel_and_serves(tiny_model_path):
    from kvstrata.runner.quant.w8a8 import int8_kernel

    srv = ServerProcess(tiny_model_path, "--quantization", "w8a8_int8",
                        "--max-total-tokens", "2048")
    try:
        info = httpx.get(srv.base_url + "/server_info", timeout=30).json()
        assert info["quantization"] == "w8a8_int8"
        q = info["quantization_info"]
        assert q["quantization"] == "w8a8_int8" and q["kernel"] == int8_kernel()[1]
        # This tiny model carries SmolLM2's tokenizer: the calibration text is used.
        assert q["smoothing"].startswith("SmoothQuant"), q
        # Reported, not compared: this model is mostly its tied embedding, which stays float
        # and gains an int8 copy for the output projection, so its weights grow.
        assert q["weight_bytes"] > 0 and q["tied_output_projection_copy"] is True
        r = httpx.post(srv.base_url + "/generate", timeout=60, json={
            "text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                 "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 4
    finally:
        srv.stop()
