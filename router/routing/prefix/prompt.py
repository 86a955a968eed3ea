"""The prompt of an OpenAI request as text, rendered the same way everywhere the router looks at it.

No tokenizer runs on the router: policies that care about the prompt (prefix hashing, cost estimates) work
on its text. Chat `messages` render as role + content in order, so turn n+1 of a conversation starts with
the exact text of turn n; a completion's `prompt` renders as itself; token ids and batches render as their
JSON (which still share a prefix when they do). Rendering is a generator of pieces so a caller that only
needs the first few KiB can stop early.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any


def content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: text as text, anything else (images) as JSON
        return "".join(
            p["text"] if isinstance(p, Mapping) and isinstance(p.get("text"), str) else stable_json(p)
            for p in content
        )
    return stable_json(content)


# What a value too deeply nested for `json.dumps` renders as (orjson parses 1,024 levels, Python's json
# recursion stops near 1,000): the request is served, its prefix just hashes to this marker.
TOO_DEEP = "\x00too-deep\x00"


def stable_json(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    except (RecursionError, ValueError):
        return TOO_DEEP


def prompt_pieces(body: Mapping[str, Any]) -> Iterator[str]:
    """The prompt text in order, in pieces, so rendering can stop once enough is produced."""
    messages = body.get("messages")
    if isinstance(messages, list):
        for msg in messages:
            if not isinstance(msg, Mapping):
                yield stable_json(msg)
                continue
            # Role and content with separators no ordinary text contains, so ("ab", "c") != ("a", "bc").
            yield f"\x1e{msg.get('role', '')}\x1f"
            content = msg.get("content")
            if isinstance(content, list):  # part by part, so a caller that has enough stops before an image
                yield from (content_text([part]) for part in content)
            else:
                yield content_text(content)
        return
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        yield prompt
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        yield prompt[0]
    elif prompt is not None:  # token ids or a batch: their JSON still shares a prefix when they do
        yield stable_json(prompt)


def prompt_length(body: Mapping[str, Any]) -> int:
    """About the length of the rendered prompt, summed without rendering: message text, role separators and
    prompt strings; non-text parts (images) and token ids count as nothing. For ratios, not for hashing."""
    messages = body.get("messages")
    if isinstance(messages, list):
        total = 0
        for msg in messages:
            if not isinstance(msg, Mapping):
                continue
            role = msg.get("role")
            total += 2 + (len(role) if isinstance(role, str) else 0)
            content = msg.get("content")
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p["text"]) for p in content
                             if isinstance(p, Mapping) and isinstance(p.get("text"), str))
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return len(prompt[0])
    return 0
