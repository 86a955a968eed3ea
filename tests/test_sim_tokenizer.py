"""The stand-in tokenizer: realistic counts, stable ids, and shared prefixes for shared text."""

from __future__ import annotations

import pytest

from worker.sim.tokenizer import VOCAB_SIZE, render_chat, token_pieces, tokenize

PROSE = (
    "Routing is the art of sending each request to the engine best placed to serve it. In a fleet of GPUs "
    "running large language models, the best engine is rarely the least busy one: a long conversation whose "
    "history is already cached on one machine is far cheaper to continue there, while a burst of short "
    "questions is better spread evenly."
)


def test_english_prose_is_about_four_characters_per_token() -> None:
    ids = tokenize(PROSE)
    assert 3.5 < len(PROSE) / len(ids) < 4.5
    assert all(0 <= i < VOCAB_SIZE for i in ids)


def test_ids_are_stable_and_depend_on_the_text() -> None:
    # Fixed values: ids must not change between processes or releases (crc32, not the salted str hash).
    assert tokenize("Hello, world!") == [8578, 878, 21707, 21971]  # "Hello" "," " world" "!"
    assert tokenize("Hello, world!") != tokenize("Hello, World!")
    assert tokenize("") == []


def test_a_shared_text_prefix_gives_a_shared_token_prefix() -> None:
    a = tokenize(PROSE + " Prefix caching rewards that.")
    b = tokenize(PROSE + " Load balancing does not.")
    base = tokenize(PROSE)
    assert a[: len(base)] == b[: len(base)] == base


def test_chat_history_renders_to_a_prefix_of_the_next_turn() -> None:
    history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there."}]
    turn1 = render_chat(history)
    turn2 = render_chat([*history, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}])
    assert turn2.startswith(turn1)
    t1, t2 = tokenize(turn1), tokenize(turn2)
    assert t2[: len(t1) - 1] == t1[:-1]  # only the piece at the seam (header newlines + reply) differs
    assert turn1.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_content_parts_render_like_the_equivalent_string() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat(parts) == render_chat([{"role": "user", "content": "a\nb"}])
    assert "assistant<|end_header_id|>\n\n<|eot_id|>" in render_chat([{"role": "assistant", "content": None}])


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], r"messages: must be a non-empty list"),
        ("hi", r"messages: must be a non-empty list"),
        (["hi"], r"messages\[0\]: must be an object"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content: must be"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\]\.type"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\]\.content\[0\]\.text"),
    ],
)
def test_render_chat_rejects_malformed_messages_naming_the_place(messages: object, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        render_chat(messages)  # type: ignore[arg-type]


def test_token_pieces_spell_the_text_one_token_each() -> None:
    text = "The quick brown fox, extraordinarily quick!\n\n  done"
    pieces = token_pieces(text)
    assert "".join(pieces) == text  # nothing lost or added: vLLM's token_strs concatenate to the text too
    assert [tokenize(p) for p in pieces] == [[i] for i in tokenize(text)]  # each piece is one token, same id


def test_generation_prompt_and_continued_final_message_follow_hf_chat_template_options() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    full = render_chat(messages)
    bare = render_chat(messages, add_generation_prompt=False)
    open_last = render_chat(messages, continue_final_message=True)
    assert full.startswith(bare) and full.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert bare.endswith("Hel<|eot_id|>")  # no header for a new answer
    assert open_last.endswith("Hel") and bare.startswith(open_last)  # the answer continues the last message
