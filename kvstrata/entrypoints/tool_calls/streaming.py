"""One streamed choice's tool calls: text chunks in, content and tool_calls deltas out.

After each chunk the detector scans the whole output so far (core.py: a partial scan only
ever grows its plain text and names), and this sends what is new: plain text, a call's
first delta (id, type, name, arguments ""), then its arguments as they become stable
(partial_json.ArgumentStreamer). At the end the final scan -- the very one a non-streamed
response is built from -- sends the rest, so the deltas add up to the non-streamed answer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvstrata.entrypoints.tool_calls.core import Scan
from kvstrata.entrypoints.tool_calls.partial_json import ArgumentStreamer


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI delta.tool_calls items


class ToolCallStream:
    def __init__(self, scan: Callable[[str, bool], Scan], call_id: Callable[[int, str], str]):
        self._scan = scan  # (text, final) -> Scan
        self._call_id = call_id  # (index, name) -> the call's id
        self.text = ""
        self.sent_content = ""
        self._args: list[ArgumentStreamer] = []

    @property
    def calls_sent(self) -> int:
        return len(self._args)

    def feed(self, chunk: str) -> StreamDelta:
        self.text += chunk
        return self._diff(self._scan(self.text, False), final=False)

    def finish(self) -> StreamDelta:
        """The rest, from the final scan; plain text the stream held back (a marker's start
        that never became one, or a call section with no valid call) goes out as text."""
        scan = self._scan(self.text, True)
        if not scan.calls and not self._args:
            scan.normal = self.text
        return self._diff(scan, final=True)

    def _diff(self, scan: Scan, final: bool) -> StreamDelta:
        out = StreamDelta()
        if scan.normal.startswith(self.sent_content):
            out.content = scan.normal[len(self.sent_content):]
            self.sent_content = scan.normal
        for index, call in enumerate(scan.calls):
            if index == len(self._args):
                self._args.append(ArgumentStreamer())
                out.tool_calls.append({"index": index, "id": self._call_id(index, call.name),
                                       "type": "function",
                                       "function": {"name": call.name, "arguments": ""}})
            streamer = self._args[index]
            if call.complete:
                delta = streamer.finish(call.args)
            elif call.args is not None and not final:
                delta = streamer.update(call.args)
            else:
                delta = ""
            if delta:
                out.tool_calls.append({"index": index, "type": "function",
                                       "function": {"arguments": delta}})
        return out
