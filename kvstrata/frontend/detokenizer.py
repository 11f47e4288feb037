"""Incremental detokenisation and stop-string trimming, plus the detokenizer process loop.

Two rules decide what text leaves this process:
1. Never half a character. A multi-byte character (emoji, CJK) can span several byte-level
   tokens; until its last byte arrives the decoded text ends in U+FFFD, so we hold it back.
2. Never a stop string, nor text that may turn into one. The engine stops on the token that
   completes a stop string; OpenAI semantics exclude the stop string from the output, so
   while streaming we hold back any tail that is a prefix of a stop string, and at the finish
   we cut the text at the stop string.
"""
from __future__ import annotations

import logging
import os

import zmq

from kvstrata.frontend import ipc
from kvstrata.protocol import RequestOutput

logger = logging.getLogger(__name__)

# How many already-final tokens to decode together with the new ones: BPE/SentencePiece
# decoders only render leading spaces correctly with some left context.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into a growing string, without ever emitting a
    partial character. Cost per step is O(new + context tokens), not O(all tokens)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # all final text so far
        # token_ids[prefix_offset:read_offset] is the context window already rendered into
        # self.text; token_ids[read_offset:] is not yet rendered.
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the text that became final. With final=True, flush
        whatever is held back (a truly invalid byte sequence then renders as U+FFFD)."""
        self.token_ids.extend(new_ids)
        if self.read_offset == len(self.token_ids):
            return ""
        context = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if full.endswith("\ufffd") and not final:
            return ""  # an incomplete multi-byte character: wait for its next byte
        delta = full[len(context):] if full.startswith(context) else full
        self.read_offset = len(self.token_ids)
        # Keep a few rendered tokens as left context for the next decode.
        self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
        self.text += delta
        return delta


def stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string
    (that tail might still become a stop string, so it must not be streamed yet)."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold


class RequestDetokState:
    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool,
                 trim_stop_token: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = stop
        self.trim_stop_token = trim_stop_token
        self.sent = 0  # chars of detok.text already sent to the api server

    def step(self, out: RequestOutput) -> str:
        ids = out.new_token_ids
        reason = out.finish_reason
        if out.finished and self.trim_stop_token and reason is not None and reason.by_token \
                and ids:
            ids = ids[:-1]  # the matched stop token (EOS, a stop_token_id) is not text
        self.detok.add(ids, final=out.finished)
        text = self.detok.text
        if not out.finished:
            end = len(text) - stop_holdback(text, self.stop)
            end = max(end, self.sent)
        else:
            end = len(text)
            reason = out.finish_reason
            if reason is not None and reason.type == "stop" and reason.matched in self.stop:
                # The stop string ends inside the last token; cut at its first occurrence
                # that we have not already streamed past. (A request registered without
                # its stop strings -- SGLang's no_stop_trim -- keeps it.)
                at = text.find(reason.matched, max(0, self.sent - len(reason.matched) + 1))
                if at >= 0:
                    end = max(at, self.sent)
        delta = text[self.sent:end]
        self.sent = end
        return delta


class Detokenizer:
    """Per-request detokenisation state; pure logic so it can be tested without sockets."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestDetokState] = {}

    def register(self, msg: ipc.RegisterDetok) -> None:
        self.states[msg.rid] = RequestDetokState(self.tokenizer, msg.stop,
                                                 msg.skip_special_tokens, msg.trim_stop_token)

    def process(self, outputs: list[RequestOutput]) -> list[ipc.TextOutput]:
        result = []
        for out in outputs:
            state = self.states.get(out.rid)
            if state is None:  # e.g. aborted before its registration: detok without stops
                state = self.states[out.rid] = RequestDetokState(self.tokenizer, [], True)
            text = state.step(out)
            if out.finished:
                del self.states[out.rid]
            reason = out.finish_reason
            result.append(ipc.TextOutput(
                rid=out.rid, text=text, new_token_ids=out.new_token_ids, finished=out.finished,
                finish_type=reason.type if reason else None,
                matched_stop=reason.matched if reason else None,
                error_message=reason.message if reason else None,
                error_status=reason.status_code if reason else None,
                prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                cached_tokens=out.cached_tokens, new_logprobs=out.new_logprobs,
                new_top_logprobs=out.new_top_logprobs, prompt_logprobs=out.prompt_logprobs,
                prompt_top_logprobs=out.prompt_top_logprobs, spec=out.spec,
            ))
        return result


def run_detokenizer_process(server_args, paths: ipc.IpcPaths, ready_conn,
                            decoder_spec: str | None = None) -> None:
    """Entry point of the detokenizer subprocess. `decoder_spec`: the launcher's tokenizer's
    decoder (tokenizer_loader.decoder_spec), else the tokenizer is loaded here."""
    from kvstrata.frontend.process_utils import die_with_parent, exit_now, setup_child_logging
    from kvstrata.frontend.tokenizer_loader import DecodeOnlyTokenizer, load_tokenizer_for

    die_with_parent()
    setup_child_logging(server_args, "detokenizer")
    try:
        detok = Detokenizer(DecodeOnlyTokenizer(decoder_spec) if decoder_spec is not None
                            else load_tokenizer_for(server_args))
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        recv.bind(paths.detokenizer_in)
        send = ctx.socket(zmq.PUSH)
        send.connect(paths.api_in)
    except Exception as e:  # report, so the launcher fails fast instead of waiting
        logger.exception("detokenizer failed to start")
        ready_conn.send_bytes(ipc.encode(ipc.ReadyMsg("detokenizer", False, repr(e))))
        return
    ready_conn.send_bytes(ipc.encode(ipc.ReadyMsg("detokenizer", True, info={"pid": os.getpid()})))
    while True:
        msg = ipc.decode(recv.recv(), "detokenizer")
        if isinstance(msg, ipc.EngineOutputs):
            send.send(ipc.encode(ipc.TextOutputs(detok.process(msg.outputs))))
        elif isinstance(msg, ipc.RegisterDetok):
            detok.register(msg)
        elif isinstance(msg, (ipc.ControlReply, ipc.LoadReport, ipc.EngineFailure)):
            send.send(ipc.encode(msg))
        elif isinstance(msg, ipc.ShutdownReq):
            break
    recv.close(linger=0)
    send.close(linger=0)
    ctx.term()
    exit_now(0)  # a clean stop: nothing left to finalise (see exit_now)
