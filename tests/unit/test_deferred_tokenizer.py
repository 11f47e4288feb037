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


def test_a_preferred_source_is_tried_first_and_none_falls_back_to_the_load():
    """The scheduler prefers the launcher's tokenizer copy (scheduler_process.py
    decode_only_from); without one (None: not exact to copy) it loads its own."""
    loads = []
    tok = DeferredTokenizer(lambda: loads.append(1) or SimpleNamespace(src="load"))
    tok.prefer(lambda: SimpleNamespace(src="copy"))
    assert tok.src == "copy" and loads == []
    tok = DeferredTokenizer(lambda: loads.append(1) or SimpleNamespace(src="load"))
    tok.prefer(lambda: None)
    assert tok.src == "load" and loads == [1]


def test_the_scheduler_reads_the_launchers_copy_from_its_pipe():
    import multiprocessing as mp

    from tokenizers import Tokenizer, models

    from kvstrata.entrypoints.scheduler_process import decode_only_from

    spec = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).to_str()
    recv, send = mp.Pipe(duplex=False)
    send.send(spec)
    copy = decode_only_from(recv)
    assert copy.decode([1, 0]) == "b a"
    assert copy.backend_tokenizer.get_vocab_size() == 2  # what grammars build their table from
    recv, send = mp.Pipe(duplex=False)
    send.send(None)  # the launcher's decode is not exact to copy: load it here
    assert decode_only_from(recv) is None
    recv, send = mp.Pipe(duplex=False)
    send.close()  # the launcher died before sending
    assert decode_only_from(recv) is None
