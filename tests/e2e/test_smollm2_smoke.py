"""One smoke test on the real default model (SmolLM2-135M-Instruct, GGUF)."""
from __future__ import annotations

import pytest

from tests.e2e.server_utils import ServerProcess, ask_capital_of_france


@pytest.mark.slow
def test_capital_of_france():
    srv = ServerProcess("smollm2-135m", "--max-total-tokens", "8192", timeout=300)
    try:
        answer = ask_capital_of_france(srv)
        assert "Paris" in answer, answer
    finally:
        srv.stop()
