"""A deterministic stand-in tokenizer and chat template for the simulated engine.

The simulator needs token *counts* that behave like a real tokenizer's (about 4 characters of English
prose per token, ~3.5 for Markdown or code, so lengths, costs and KV usage are realistic) and token *ids*
whose prefixes are shared exactly when the texts share a prefix, so that automatic prefix caching hits on
a repeated system prompt or on a conversation's history. It does not need a vocabulary.

Text is split into pieces the way GPT-style BPE pre-tokenisers do (a word with its leading whitespace, a
run of punctuation with its leading whitespace, or a whitespace run), pieces longer than five characters
are cut into five-character chunks (five, not four, because whole common words are single BPE tokens: this
lands at ~3.9 characters per token on English prose), and each piece maps to an id by a stable hash (crc32
mod 32000; Python's `hash` of a str is salted per process and would not do). Splitting is left to right
with no lookahead beyond the piece, so two texts with a common prefix get a common token prefix up to the
piece that straddles the point where they differ, as with a real tokenizer.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from typing import Any

VOCAB_SIZE = 32000
_CHUNK = 5
_PIECE = re.compile(r"\s*\w+|\s*[^\w\s]+|\s+")

# Llama-3 style headers: each message ends with a fixed delimiter, so a conversation's history renders to
# the same text (and tokens) in every later turn.
_BOS = "<|begin_of_text|>"
_HEADER = "<|start_header_id|>{role}<|end_header_id|>\n\n"
_EOT = "<|eot_id|>"


def tokenize(text: str) -> list[int]:
    return [_id(piece) for piece in token_pieces(text)]


def token_pieces(text: str) -> list[str]:
    """The text of each token `tokenize` returns an id for (what vLLM's /tokenize calls `token_strs`)."""
    pieces: list[str] = []
    for match in _PIECE.finditer(text):
        piece = match.group()
        stripped = piece.lstrip()
        lead = piece[: len(piece) - len(stripped)]
        if len(stripped) <= _CHUNK:
            pieces.append(piece)
            continue
        # The leading whitespace stays with the first chunk, like BPE's "Ġword".
        pieces.append(lead + stripped[:_CHUNK])
        pieces.extend(stripped[i : i + _CHUNK] for i in range(_CHUNK, len(stripped), _CHUNK))
    return pieces


def _id(piece: str) -> int:
    return zlib.crc32(piece.encode("utf-8", "surrogatepass")) % VOCAB_SIZE


def render_chat(messages: Sequence[Any], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """The prompt text for an OpenAI-style `messages` list, ending with the assistant's header.

    As with a Hugging Face chat template: `add_generation_prompt=False` leaves out that final header, and
    `continue_final_message=True` also leaves the last message open (no end-of-turn), for a client that
    prefills the start of the answer. vLLM's /tokenize takes both options.

    Content may be a string, null (an assistant turn that only called tools) or a list of parts, of
    which the `text` parts are used. Malformed input raises ValueError naming the message index, so a
    server can answer 400.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages: must be a non-empty list")
    out = [_BOS]
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}]: must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role: must be a non-empty string")
        out.append(_HEADER.format(role=role))
        out.append(_content_text(i, msg.get("content")))
        out.append(_EOT)
    if continue_final_message:
        out.pop()  # the last message's end-of-turn
    elif add_generation_prompt:
        out.append(_HEADER.format(role="assistant"))
    return "".join(out)


def _content_text(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content: must be a string, null or a list of parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"messages[{i}].content[{j}]: must be an object")
        if part.get("type") != "text":
            raise ValueError(f"messages[{i}].content[{j}].type: only 'text' parts are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"messages[{i}].content[{j}].text: must be a string")
        texts.append(text)
    return "\n".join(texts)
