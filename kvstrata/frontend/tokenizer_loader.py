"""Load only the tokenizer (never the weights) for the api server and the detokenizer; the
scheduler's, deferred."""
from __future__ import annotations

import threading


def load_tokenizer_for(server_args):
    from kvstrata.config.model_source import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(server_args.model_path),
                          tokenizer_path=getattr(server_args, "tokenizer_path", None))


class DeferredTokenizer:
    """A tokenizer loaded off the start-up path: the scheduler process needs one only to find
    stop strings, and loading it imports transformers (~1.5 s on 2 cores, while the model
    loads). `start_loading()` (after the process reported ready) loads it on a thread; any
    attribute access waits for it (or loads it now), so users see a plain tokenizer."""

    def __init__(self, load):
        self._load = load
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._value = None
        self._error: BaseException | None = None

    def start_loading(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tokenizer-load",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._load()
        except BaseException as e:  # re-raised to the first user
            self._error = e

    def get(self):
        self.start_loading()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value

    def __getattr__(self, name: str):
        return getattr(self.get(), name)
