"""Structured output in the runner: one llguidance matcher per constrained request, which says
before each sampled token which tokens may come next (a mask the sampler applies last) and
takes each sampled token after.

The runner owns it because the runner samples: the matcher must see every token the moment it
is drawn, before the next step's mask, on every path that draws one (a plain step, a PD
prefill server's first token). A request that arrives with output already (a PD decode
server's first token from the prefill server, a retracted request coming back) replays it.
Every TP rank keeps its own matchers: they sample the same tokens, so they agree.

The llguidance tokenizer (the vocabulary as byte strings) is built from the model's tokenizer
on the first constrained request (~0.5 s for SmolLM2's 49152 tokens), not at start-up.

Compiles run on one thread, under the API's limits (protocol/grammar_limits.py), and are
kept by grammar text: a request gets a copy of the compiled matcher (llguidance's deep_copy,
~0.1 ms), so a grammar that comes back (a tool set, a schema) compiles once. The scheduler
loop starts a request's compile when the request arrives and hands it to the engine once it
is done (entrypoints/grammar_hold.py), so that no step waits for a compile. Under TP every
rank has its own backend: rank 0 tells the others a held request's grammar at once
(`compiled_key`) and asks them whether it is done (`compile_done`) before handing it over
(runner/parallel/tp_runner.py), so their first sample does not wait either.
"""
from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvstrata.config.model_source import load_tokenizer, resolve_model_path
from kvstrata.protocol.grammar import (GRAMMAR_FAILED, clean_message, grammar_error,
                                       llguidance_grammar)
from kvstrata.protocol.grammar_limits import parser_limits
from kvstrata.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# Compiled matchers kept by grammar text (a large one holds a few MB).
COMPILED_CACHE_SIZE = 32


class GrammarBackend:
    """Builds matchers for one model: `matcher(params, output_ids)` for a new request."""

    def __init__(self, model_path: str, tokenizer_path: str | None, vocab_size: int,
                 eos_token_ids: list[int], json_options: dict):
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.json_options = json_options
        pattern = json_options.get("whitespace_pattern")
        if pattern is not None and grammar_error("regex", pattern):
            raise ValueError(f"--constrained-json-whitespace-pattern is not a valid regular "
                             f"expression: {grammar_error('regex', pattern).splitlines()[0]}")
        self._tokenizer = None
        self.hf_tokenizer = None  # the engine's (build_engine sets it), else loaded here
        self._lock = threading.Lock()
        self._executor = None
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        # (field, text) -> Future of its compiled, unused matcher (LRU)
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.compiles_started = self.compiles_late = 0  # stats()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance  # noqa: PLC0415 - only when a grammar arrives

                # The engine's own tokenizer when it has one (the scheduler's loads on a
                # thread: a second load here imported transformers beside it, and the
                # half-imported module failed -- the scheduler died on its first grammar)
                hf = self.hf_tokenizer or load_tokenizer(
                    resolve_model_path(self.model_path), tokenizer_path=self.tokenizer_path)
                backend = copy.copy(hf.backend_tokenizer)  # the tokenizers-library one
                backend.no_padding()
                backend.no_truncation()
                # Ids past the tokenizer (a padded output head) are never allowed; the
                # sampler cuts the mask to the logits it has.
                n_vocab = max(backend.get_vocab_size(with_added_tokens=True), self.vocab_size)
                self._tokenizer = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=n_vocab, eos_token=self.eos_token_ids)
            return self._tokenizer

    @property
    def executor(self):
        """llguidance's thread pool for a batch's masks: as many threads as torch uses (masks
        are filled between forwards, when those cores are free)."""
        if self._executor is None:
            import llguidance  # noqa: PLC0415

            self._executor = llguidance.LLExecutor(max(1, torch.get_num_threads()))
        return self._executor

    def is_special(self, text: str) -> bool:
        """Whether `text` is one special token of the tokenizer (a structural tag's trigger
        such as Qwen's <tool_call>: the model emits that token, not its letters)."""
        tok = self.tokenizer()
        ids = tok.tokenize_str(text, parse_special=True)
        return len(ids) == 1 and tok.is_special_token(ids[0])

    def compiled(self, params: SamplingParams) -> Future:
        """The Future of the request's grammar compiled (a matcher no token has advanced),
        started on the compile thread unless it is cached; nothing here waits for it."""
        return self.compiled_key(*params.grammar_key)

    def compiled_key(self, field: str, text: str) -> Future:
        """compiled() by the grammar's (field, text): a TP rank > 0 is told only those
        (tp_runner.py's "grammar_compile")."""
        key = (field, text)
        future = self._compiled.get(key)
        if future is not None and future.done() and future.exception() is not None:
            future = None  # never expected (the API checked it): try again, not forever
        if future is None:
            future = self._compiler.submit(self._compile, *key)
            self.compiles_started += 1
            self._compiled[key] = future
            while len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return future

    def compile_done(self, field: str, text: str) -> bool:
        """Whether the grammar's compile has ended (compiled, or failed: the runner reports
        that at the request's step, as on one rank). One no longer kept (32 others came
        since) starts again and is not done."""
        future = self._compiled.get((field, text))
        return (future or self.compiled_key(field, text)).done()

    def stats(self) -> dict:
        """Counters for /debug/grammar: compiles started, and requests whose first step
        found their compile still running (it waited; the server holds requests until every
        rank compiled, so there it stays 0)."""
        return {"compiles_started": self.compiles_started, "compiles_late": self.compiles_late}

    def _compile(self, field: str, text: str):
        import llguidance  # noqa: PLC0415

        tokenizer = self.tokenizer()
        grammar = llguidance_grammar(field, text, self.json_options, self.is_special)
        return llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())

    def matcher(self, params: SamplingParams, output_ids: list[int]) -> "GrammarState | None":
        field = params.grammar_field
        if field is None:
            return None
        gate = ThinkingGate(*params.reasoning_gate) if params.reasoning_gate else None
        # the output the grammar has seen (a thinking section's tokens are not its)
        replay = [t for t in output_ids if gate is None or gate.take(t)]
        # Off the step: a compile still running (a request not held by the scheduler loop:
        # LLM()) overlaps the request's prefill; its first sample waits (counted: stats()).
        compiled = self.compiled(params)
        self.compiles_late += not compiled.done()
        tokenizer = self.tokenizer()
        return GrammarState(compiled, self.vocab_size, (tokenizer.vocab_size + 31) // 32,
                            self.executor, tokenizer, gate, replay)


class ThinkingGate:
    """SGLang's grammar after reasoning: a thinking model's section is free text, so the
    grammar waits while the answer is inside one. MAYBE: the next token may open a section
    (the start token is allowed beside the grammar's); THINKING: no mask until the end
    token; OPEN: the grammar holds."""
    MAYBE, THINKING, OPEN = 0, 1, 2

    def __init__(self, start: int, end: int, inside: int):
        self.start, self.end = start, end
        self.state = self.THINKING if inside else self.MAYBE if start >= 0 else self.OPEN

    def take(self, token: int) -> bool:
        """Moves past one drawn token; True when the token is the grammar's."""
        if self.state == self.OPEN:
            return True
        if self.state == self.MAYBE:
            self.state = self.THINKING if token == self.start else self.OPEN
            return self.state == self.OPEN
        if token == self.end:
            self.state = self.OPEN
        return False


def _advance(matcher, token: int) -> None:
    """A drawn token into the matcher (a failed or finished one takes nothing more)."""
    if not matcher.is_error() and not matcher.is_stopped():
        matcher.consume_token(int(token))


class GrammarState:
    """One request's matcher. `allowed()` is a bool mask over the vocabulary (computed once
    per token: fill_masks computes a batch's at once); `accept(tok)` advances it. A matcher
    in an error state (a token it could not take: the request's own tokens before a restart
    under another grammar, say) allows the EOS tokens only, so the request ends instead of
    running on unconstrained."""

    def __init__(self, matcher, vocab_size: int, mask_words: int, executor, tokenizer=None,
                 gate: ThinkingGate | None = None, replay: list[int] = ()):
        # an LLMatcher, or the Future of a compiled one (GrammarBackend.compiled), which the
        # first use copies and advances past `replay` (the output it has not seen)
        self._matcher = matcher
        self._replay = list(replay)
        self.gate = gate
        self._tokenizer = tokenizer
        self.error: str | None = None  # why its compilation raised (never expected)
        self.vocab_size = vocab_size
        self.mask_words = mask_words  # int32 words of llguidance's bitmask
        self.executor = executor  # the backend's llguidance.LLExecutor (parallel masks)
        self.reported = False  # its failure went up to the engine once
        self._mask: torch.Tensor | None = None

    def allowed(self) -> torch.Tensor | None:
        """The mask; None while the answer is inside a thinking section (no mask)."""
        if not self.active:
            return None
        if self._mask is None:
            fill_masks([self])
        return self._mask

    @property
    def needs_mask(self) -> bool:
        """Active and without a mask for the next token yet (fill_masks computes those)."""
        return self._mask is None and self.active

    def set_mask(self, mask: torch.Tensor) -> None:
        """The next token's allowed-token mask, computed in a batch by fill_masks."""
        self._mask = mask

    @property
    def active(self) -> bool:
        return self.gate is None or self.gate.state != ThinkingGate.THINKING

    def accept(self, token: int) -> None:
        self._mask = None
        if self.gate is None or self.gate.take(token):
            _advance(self.matcher, token)

    @property
    def matcher(self):
        """The LLMatcher (waits for its compilation the first time)."""
        if isinstance(self._matcher, Future):
            try:
                matcher = self._matcher.result().deep_copy()  # the cached one stays unused
                for tok in self._replay:
                    _advance(matcher, tok)
                self._matcher = matcher
            except Exception as e:  # noqa: BLE001 - the API checked it; never fatal here
                import llguidance  # noqa: PLC0415

                logger.warning("grammar failed to compile: %r", e)
                self.error = f"{type(e).__name__}: {e}"
                # an empty grammar: a matcher in its error state (it allows EOS only)
                self._matcher = llguidance.LLMatcher(self._tokenizer, "", log_level=0)
        return self._matcher

    @property
    def failed(self) -> bool:
        """Its matcher failed (False while it still compiles: asked again next step)."""
        if isinstance(self._matcher, Future) and not self._matcher.done():
            return False
        return self.matcher.is_error()


def fill_masks(grammars) -> None:
    """Computes the next-token masks of every GrammarState among `grammars` that has none yet,
    in one llguidance call that spreads the matchers over its threads (the sampler calls it
    once per batch: 16 JSON rows of SmolLM2 took 0.19 ms each one by one)."""
    todo = [g for g in grammars if isinstance(g, GrammarState) and g.needs_mask]
    if not todo:
        return
    words = todo[0].mask_words
    bits = np.zeros((len(todo), words), dtype=np.int32)
    todo[0].executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(todo)],
                                             bits.ctypes.data, words * 4, len(todo))
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
    masks = torch.from_numpy(allowed[:, : todo[0].vocab_size].view(np.bool_))
    for g, mask in zip(todo, masks):
        if g.gate is not None and g.gate.state == ThinkingGate.MAYBE \
                and g.gate.start < mask.shape[0]:
            mask[g.gate.start] = True  # the answer may open a thinking section instead
        g.set_mask(mask)


def new_failures(states) -> dict[str, str]:
    """rid -> llguidance's message, for each (rid, GrammarState | None) whose matcher failed
    since the last call (RunnerOutput.grammar_errors)."""
    failed = {}
    for rid, state in states:
        if state is not None and not state.reported and state.failed:
            state.reported = True
            # llguidance's message, without what it appends (parser state, a backtrace)
            failed[rid] = GRAMMAR_FAILED + clean_message(state.error or
                                                         state.matcher.get_error())
    return failed
