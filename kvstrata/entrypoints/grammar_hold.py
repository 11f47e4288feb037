"""SGLang's grammar queue, in the scheduler loop: a request with a grammar joins the engine only
once its grammar has compiled, so that no engine step waits for a compile.

The runner compiles a grammar on a thread and a request's first sample needs it: added at
once, a request whose grammar compiles for seconds held up that step, and with it every
other request's tokens. Here the compile starts when the request arrives
(GrammarBackend.compiled, kept by grammar text) and the request waits outside the engine;
the loop hands it over once the compile is done -- the runner then copies the compiled
matcher instead of waiting. The API server has already refused what is past the limits or
slow to compile (api/grammar_check.py), so the wait is short.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class GrammarHold:
    def __init__(self, backend: Any):
        # the runner's GrammarBackend (rank 0's under TP); None: nothing is held
        self.backend = backend
        self.held: dict[str, tuple[Any, Future]] = {}  # rid -> (request, compile), in order

    @classmethod
    def of(cls, engine: Any) -> "GrammarHold":
        return cls(getattr(getattr(engine, "runner", None), "grammar", None))

    def hold(self, req: Any) -> bool:
        """True when `req` waits here for its grammar (the caller does not add it)."""
        sp = req.sampling_params
        if self.backend is None or sp.grammar_field is None:
            return False
        compiled = self.backend.compiled(sp)
        if compiled.done():
            return False
        self.held[req.rid] = (req, compiled)
        return True

    def ready(self) -> list:
        """The held requests whose grammar is compiled (or failed: the runner reports that),
        in arrival order; they are no longer held."""
        rids = [rid for rid, (_, compiled) in self.held.items() if compiled.done()]
        return [self.held.pop(rid)[0] for rid in rids]

    def release(self, rid: str) -> Any | None:
        """The held request `rid` (an abort: the engine ends it as it ends any), or None."""
        held = self.held.pop(rid, None)
        return None if held is None else held[0]
