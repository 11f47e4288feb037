"""SGLang's grammar queue, in the scheduler loop: a request with a grammar joins the engine only
once its grammar has compiled, so that no engine step waits for a compile.

The runner compiles a grammar on a thread and a request's first sample needs it: added at
once, a request whose grammar compiles for seconds held up that step, and with it every
other request's tokens. Here the compile starts when the request arrives
(GrammarBackend.compiled, kept by grammar text) and the request waits outside the engine;
the loop hands it over once the compile is done -- the runner then copies the compiled
matcher instead of waiting. The API server has already refused what is past the limits or
slow to compile (api/grammar_check.py), so the wait is short.

Under tensor parallelism every rank samples, with its own backend, and the ranks meet in
collectives: one rank still compiling at the first step held up all of them. So the engine's
runner (a TPDriver) also tells every other rank the grammar on arrival (`start_grammar`,
answered at once) and, once rank 0's compile is done, is asked which held grammars every
rank has compiled (`grammars_done`); a request goes over only then. A lost rank ends those
calls with an error (TPDriver's bounded waits), which ends the loop as a failed step does.
One rank: no driver, no calls.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class GrammarHold:
    def __init__(self, backend: Any, ranks: Any = None):
        # the runner's GrammarBackend (rank 0's under TP); None: nothing is held
        self.backend = backend
        # TP: the driver (start_grammar / grammars_done / grammar_stats); None: one rank
        self.ranks = ranks
        self.held: dict[str, tuple[Any, Future]] = {}  # rid -> (request, compile), in order

    @classmethod
    def of(cls, engine: Any) -> "GrammarHold":
        runner = getattr(engine, "runner", None)
        # duck-typed: a TPDriver has these; a ModelRunner (or a test's fake) does not
        ranks = runner if callable(getattr(runner, "grammars_done", None)) else None
        return cls(getattr(runner, "grammar", None), ranks)

    def hold(self, req: Any) -> bool:
        """True when `req` waits here for its grammar (the caller does not add it)."""
        sp = req.sampling_params
        if self.backend is None or sp.grammar_field is None:
            return False
        compiled = self.backend.compiled(sp)
        everywhere = self.ranks is None or self.ranks.start_grammar(sp.grammar_key)
        if compiled.done() and everywhere:
            return False
        self.held[req.rid] = (req, compiled)
        return True

    def ready(self) -> list:
        """The held requests whose grammar is compiled (or failed: the runner reports that)
        on every rank, in arrival order; they are no longer held."""
        rids = [rid for rid, (_, compiled) in self.held.items() if compiled.done()]
        if rids and self.ranks is not None:  # asked only once rank 0 has it
            keys = [self.held[rid][0].sampling_params.grammar_key for rid in rids]
            unique = list(dict.fromkeys(keys))  # one schema, many requests: asked once
            done = dict(zip(unique, self.ranks.grammars_done(unique)))
            rids = [rid for rid, key in zip(rids, keys) if done[key]]
        return [self.held.pop(rid)[0] for rid in rids]

    def release(self, rid: str) -> Any | None:
        """The held request `rid` (an abort: the engine ends it as it ends any), or None."""
        held = self.held.pop(rid, None)
        return None if held is None else held[0]

    def stats(self) -> list[dict]:
        """Every rank's compile counters (GrammarBackend.stats), in rank order: /debug/grammar."""
        if self.backend is None:
            return []
        return self.ranks.grammar_stats() if self.ranks is not None else [self.backend.stats()]
