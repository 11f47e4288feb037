"""The scheduler process's tokenizer loads after the process reported ready
(frontend/tokenizer_loader.py DeferredTokenizer): nothing loads before start_loading() or a
use, it loads once, a use waits for it, and a load error reaches the user."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from kvstrata.frontend.tokenizer_loader import DeferredTokenizer


def test_loads_once_on_a_thread_and_uses_wait_for_it():
    gate, calls = threading.Event(), []

    def load():
        calls.append(threading.current_thread().name)
        gate.wait(5)
        return SimpleNamespace(decode=lambda ids, **kw: "+".join(map(str, ids)), eos=2)

    tok = DeferredTokenizer(load)
    assert calls == []  # nothing before start_loading() or a use
    tok.start_loading()
    tok.start_loading()
    threading.Timer(0.05, gate.set).start()
    assert tok.decode([1, 2]) == "1+2"  # waits for the thread
    assert tok.eos == 2 and calls == ["tokenizer-load"]


def test_a_use_without_start_loads_it_and_errors_reach_the_user():
    assert DeferredTokenizer(lambda: SimpleNamespace(x=1)).x == 1

    def broken():
        raise OSError("no tokenizer.json")
    tok = DeferredTokenizer(broken)
    tok.start_loading()
    with pytest.raises(OSError, match="no tokenizer.json"):
        tok.decode([1])
