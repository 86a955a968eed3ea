"""How many output tokens an answer had, read off the bytes the proxy streams through, without parsing them.

Used only for requests with a cost estimate (router/routing/cost.py learns from it). The proxy hands every chunk
to `OutputCounter.feed` and, when the body ended normally, asks `finish` for the count; the bytes
themselves are never changed, and only the first chunks (until two whole events) and the last two are held.

- **Usage first.** A non-streaming answer from vLLM (and OpenAI) ends with `"usage": {"prompt_tokens": P,
  "completion_tokens": C, ...}`; a stream carries the same in its last event when the client asked for
  `stream_options.include_usage`. `finish` looks for the last `"completion_tokens":` in the last two chunks
  (two `rfind`s, no JSON parse), and for `"prompt_tokens":` beside it (prompt calibration).
- **Else count stream events.** vLLM sends one SSE event per engine step of a choice, so the number of
  events is the number of generated tokens, minus the events that carry none: the opening role
  announcement of a chat stream (`{"role": "assistant", "content": ""}`), a usage-only event
  (`"choices": []`), an empty `"delta": {}` closing a choice (OpenAI's style), and `[DONE]`. Only the head
  and the tail of a stream can hold those, so only they are parsed. Every other chunk costs one C-level
  `bytes.count(b"\\n")` and a `len`: each event is `data: <json>\\n\\n` and JSON never holds a raw newline
  (it escapes them), so two newlines are one event, and a single byte can never be split between two
  chunks. A stream that ends with an error event teaches nothing.
- **And the text's size.** vLLM merges steps into one event when its API server falls behind the engine
  (under load, or with a fast model: `RequestOutputCollector` adds up the outputs nobody has taken yet), so
  the event count is only a lower bound. `finish` therefore also estimates the bytes of generated text:
  the stream's bytes minus the non-token events minus the per-event envelope (an event's length minus its
  text, measured on the first and the last token events; the smaller is taken, the final event carrying
  extra fields and an OpenAI-style first event the role). router/routing/cost.py turns that into tokens with the
  model's bytes per output token (learned from streams that carry usage) and prefers it when it exceeds
  the event count.

Limits: with `n > 1`, an interleaved closing event of one choice may be counted as a token. SSE comments or
multi-line `data:` fields (which vLLM does not send) would be miscounted. The tail is the last two chunks: a
usage event split over three chunks at the very end falls back to the event count.
"""

from __future__ import annotations

from typing import NamedTuple

import orjson

TAIL_BYTES = 8192  # usage and the closing events fit in this with room to spare
MAX_EDGE_EVENTS = 8  # head or tail events parsed at most
TEXT_FIELDS = ("content", "text", "reasoning_content", "reasoning")


class OutputCount(NamedTuple):
    output_tokens: int | None  # usage's count, or the stream's token events; None: nothing countable
    prompt_tokens: int | None  # the engine's count, when the answer carried usage
    source: str  # "usage", "stream" or "unknown"
    text_bytes: int | None = None  # streams: the estimated bytes of generated text (JSON-escaped)


class OutputCounter:
    __slots__ = ("newlines", "size", "_head", "_head_done", "_prev", "_last")

    def __init__(self) -> None:
        self.newlines = 0
        self.size = 0
        self._head = b""  # the first chunks, until they hold two whole events (the role and the first token)
        self._head_done = False
        self._prev = b""
        self._last = b""

    def feed(self, chunk: bytes) -> None:
        self.newlines += chunk.count(b"\n")
        self.size += len(chunk)
        if not self._head_done:
            head = self._head = self._head + chunk  # no copy while the head is empty
            self._head_done = head.count(b"\n\n") >= 2 or len(head) >= TAIL_BYTES
        self._prev = self._last
        self._last = chunk

    def events(self) -> int:
        """The events streamed so far, for an answer cut short (no `finish`): about its tokens, counting the
        role announcement and `[DONE]` if they came. 0 for a body that is not an event stream."""
        return self.newlines // 2 if self._head.startswith(b"data:") else 0

    def finish(self, *, event_stream: bool) -> OutputCount:
        last = self._last
        tail = (self._prev[-TAIL_BYTES:] + last) if len(last) < TAIL_BYTES else last[-TAIL_BYTES:]
        completion = _usage_field(tail, b'"completion_tokens":')
        usage_prompt = _usage_field(tail, b'"prompt_tokens":') if completion is not None else None
        if not event_stream or not self._head:
            if completion is not None:
                return OutputCount(completion, usage_prompt, "usage")
            return OutputCount(None, None, "unknown")
        events, text_bytes = self._stream_events(tail)
        if completion is not None:
            return OutputCount(completion, usage_prompt, "usage", text_bytes)
        if events is None:
            return OutputCount(None, None, "unknown")
        return OutputCount(events, None, "stream", text_bytes)

    def _stream_events(self, tail: bytes) -> tuple[int | None, int | None]:
        """(token events, text bytes) of a stream; (None, None) if it ended with an error event."""
        last = self._last
        tokens = self.newlines // 2 + (0 if last.endswith(b"\n") else 1)  # a last event without its blank line
        other_bytes = 0  # of the events that carry no token, and the envelope of the first token event
        first = 0  # 1 when the first token event's envelope is in other_bytes (it may carry the role too)
        envelope = None  # the smallest envelope (event bytes minus text bytes) of the token events parsed
        for payload, size in _first_events(self._head, MAX_EDGE_EVENTS):
            parsed = _loads(payload)
            if not _is_role_announcement(parsed):
                text = _text_bytes(parsed)
                if text is not None:
                    other_bytes += size - text
                    first = 1
                    envelope = size - text
                break
            tokens -= 1
            other_bytes += size
        for payload, size in reversed(_last_events(tail, MAX_EDGE_EVENTS)):
            parsed = None if payload == b"[DONE]" else _loads(payload)
            if isinstance(parsed, dict) and "error" in parsed:
                return None, None
            if payload == b"[DONE]" or _carries_no_token(parsed):
                tokens -= 1
                other_bytes += size
                continue
            text = _text_bytes(parsed)  # the last token event: its envelope is the other sample
            if text is not None:
                envelope = size - text if envelope is None else min(envelope, size - text)
            break
        tokens = max(tokens, 0)
        if envelope is None or tokens == 0:
            return tokens, None
        return tokens, max(0, self.size - other_bytes - (tokens - first) * envelope)


def _usage_field(tail: bytes, name: bytes) -> int | None:
    i = tail.rfind(name)
    if i < 0:
        return None
    j = i + len(name)
    while j < len(tail) and tail[j] in b" \t":
        j += 1
    k = j
    while k < len(tail) and 48 <= tail[k] <= 57:
        k += 1
    return int(tail[j:k]) if k > j else None


def _first_events(data: bytes, n: int) -> list[tuple[bytes, int]]:
    blocks = data.split(b"\n\n", n)
    if len(blocks) > n:
        blocks.pop()  # the rest, not split
    return _events(blocks)


def _last_events(data: bytes, n: int) -> list[tuple[bytes, int]]:
    blocks = data.rsplit(b"\n\n", n + 1)  # (the stream's final separator leaves an empty last block)
    if len(blocks) > n + 1:
        blocks.pop(0)
    return _events(blocks)


def _events(blocks: list[bytes]) -> list[tuple[bytes, int]]:
    """(payload, bytes on the wire) of the `data:` events among blocks split at blank lines; a partial event
    at either end, which does not start with `data:`, is skipped."""
    out = []
    for block in blocks:
        stripped = block.strip()
        if stripped.startswith(b"data:"):
            out.append((stripped[5:].strip(), len(block) + 2))
    return out


def _loads(payload: bytes) -> object:
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None


def _is_role_announcement(parsed: object) -> bool:
    if not isinstance(parsed, dict):
        return False
    choices = parsed.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or "role" not in delta:
            return False
        if delta.get("tool_calls") or any(delta.get(name) for name in TEXT_FIELDS):
            return False
    return True


def _carries_no_token(parsed: object) -> bool:
    """A usage-only event or one whose choices are all an empty `delta: {}`."""
    if not isinstance(parsed, dict):
        return False
    choices = parsed.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("delta") != {} or not choice.get("finish_reason"):
            return False
    return True  # (an empty list too: a usage-only event)


def _text_bytes(parsed: object) -> int | None:
    """The bytes of generated text in one token event as it is on the wire (JSON-escaped), or None if it is
    not a completion chunk."""
    choices = parsed.get("choices") if isinstance(parsed, dict) else None
    if not isinstance(choices, list):
        return None
    total = 0
    for choice in choices:
        if not isinstance(choice, dict):
            return None
        delta = choice.get("delta")
        fields = delta if isinstance(delta, dict) else choice  # chat deltas, or a completion's `text`
        for name in TEXT_FIELDS:
            value = fields.get(name)
            if value and isinstance(value, str):
                total += len(orjson.dumps(value)) - 2  # escaped, as on the wire
        calls = fields.get("tool_calls")
        if calls and isinstance(calls, list):
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                arguments = function.get("arguments") if isinstance(function, dict) else None
                if arguments and isinstance(arguments, str):
                    total += len(orjson.dumps(arguments)) - 2
    return total
