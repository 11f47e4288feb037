"""One smoke test on the real default model (SmolLM2-135M-Instruct, GGUF)."""
from __future__ import annotations

import pytest

from tests.e2e.server_utils import ServerProcess


@pytest.mark.slow
def test_capital_of_france():
    import openai

    srv = ServerProcess("smollm2-135m", "--max-total-tokens", "8192", timeout=300)
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(
            model="smollm2-135m", temperature=0, max_tokens=24,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
    finally:
        srv.stop()
