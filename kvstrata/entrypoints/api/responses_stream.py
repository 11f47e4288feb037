"""/v1/responses with stream: the chat route's deltas (serving_chat.chat_deltas: reasoning,
content, tool_calls items) as the Responses API's events -- response.created and
.in_progress, per output item .output_item.added, its deltas (reasoning_text,
output_text, function_call_arguments), their .done events and .output_item.done, then
response.completed (or .incomplete at max_output_tokens) with the whole response, whose
output items are the ones the events built."""
from __future__ import annotations

import msgspec

from kvstrata.entrypoints.api.responses_api import new_id, response_object


class ResponsesEvents:
    def __init__(self, base: dict):
        self.base = base  # response_object(...) without output: created / in_progress
        self.seq = 0
        self.items: list[dict] = []  # output items so far, in their final form
        self.open: dict | None = None  # the item being written

    def event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"

    def start(self) -> list[bytes]:
        response = {**self.base, "status": "in_progress", "output": [], "usage": None,
                    "incomplete_details": None}
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def feed(self, delta: dict) -> list[bytes]:
        out = []
        if delta.get("reasoning_content"):
            out += self._ensure("reasoning")
            self.open["content"][0]["text"] += delta["reasoning_content"]
            out.append(self.event("response.reasoning_text.delta", **self._where(),
                                  content_index=0, delta=delta["reasoning_content"]))
        if delta.get("content"):
            out += self._ensure("message")
            self.open["content"][0]["text"] += delta["content"]
            out.append(self.event("response.output_text.delta", **self._where(),
                                  content_index=0, delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a new call: its own item
                out += self._close()
                self.open = {"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                             "name": call["function"]["name"], "arguments": "",
                             "status": "in_progress"}
                out.append(self._added())
            args = call["function"].get("arguments", "")
            if args:
                self.open["arguments"] += args
                out.append(self.event("response.function_call_arguments.delta",
                                      **self._where(), delta=args))
        return out

    def finish(self, body, rid: str, model: str, created: int, finish: str | None,
               last) -> list[bytes]:
        out = self._close()
        response = response_object(body, rid, model, created, self.items, finish, last)
        kind = "response.incomplete" if response["status"] == "incomplete" \
            else "response.completed"
        return out + [self.event(kind, response=response)]

    # ---- items -----------------------------------------------------------------------
    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _added(self) -> bytes:
        return self.event("response.output_item.added", output_index=len(self.items),
                          item={**self.open, **({"content": []} if "content" in self.open
                                                else {})})

    def _ensure(self, kind: str) -> list[bytes]:
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self._close()
        if kind == "reasoning":
            self.open = {"type": "reasoning", "id": new_id("rs"), "summary": [],
                         "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            self.open = {"type": "message", "id": new_id("msg"), "status": "in_progress",
                         "role": "assistant", "content": [
                             {"type": "output_text", "text": "", "annotations": [],
                              "logprobs": []}]}
        out.append(self._added())
        if kind == "message":
            out.append(self.event("response.content_part.added", **self._where(),
                                  content_index=0, part={"type": "output_text", "text": "",
                                                         "annotations": []}))
        return out

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items)}
        out = []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", **where, content_index=0,
                                  text=part["text"], logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", **where,
                                  name=item["name"], arguments=item["arguments"]))
        if "status" in item:
            item["status"] = "completed"
        self.items.append(item)
        out.append(self.event("response.output_item.done", output_index=len(self.items) - 1,
                              item=item))
        return out
