"""The prefill book (router/routing/prefill.py): pending prompt tokens per endpoint, closed at the first byte, and the
prefill speed it measures from streamed first tokens."""

from __future__ import annotations

import random

import pytest

from router.routing.prefill import SPEED_WINDOW, PrefillBook


def test_pending_prefill_is_booked_per_endpoint_and_closed_once() -> None:
    book = PrefillBook()
    a = book.start("e", 1000.0, 0.0, streamed=True)
    b = book.start("e", 0.3, 0.0, streamed=True)
    book.start("f", 50.0, 0.0, streamed=True)
    assert (book.pending("e"), book.pending("f"), book.pending("idle")) == (pytest.approx(1000.3), 50.0, 0.0)
    assert (a.ahead, b.ahead) == (1000.0, pytest.approx(1000.3))  # the work ahead of each, its own included
    book.first_token(a, 1.0)
    book.first_token(a, 2.0)  # a second first byte (or an end after it) changes nothing
    book.end(a)
    assert book.pending("e") == pytest.approx(0.3)
    book.end(b)  # a request that failed before its first byte
    assert book.pending("e") == 0.0  # exactly zero: no float residue on an idle endpoint
    assert book.speed("e") == pytest.approx(1000.0)  # only a's wait taught it: 1,000 tokens in 1 s


def test_speed_is_work_over_wait_of_streamed_first_tokens_only() -> None:
    book = PrefillBook()
    assert book.speed("e") is None
    # A tiny prompt at 1,000 tokens/s, a huge one at 2,000: the ratio of the means (4,020 tokens over 2.02 s,
    # 1,990 tokens/s: the big prompt's pace), not the mean of the ratios (1,500).
    book.first_token(book.start("e", 20.0, 10.0, streamed=True), 10.02)
    book.first_token(book.start("e", 4000.0, 20.0, streamed=True), 22.0)
    assert book.speed("e") == pytest.approx(4020.0 / 2.02)
    # A non-streamed answer's first byte comes at its end: it leaves the book but teaches nothing.
    unstreamed = book.start("e", 4000.0, 30.0, streamed=False)
    book.first_token(unstreamed, 90.0)
    assert book.pending("e") == 0.0 and book.speed("e") == pytest.approx(4020.0 / 2.02)
    book.end(book.start("e", 500.0, 40.0, streamed=True))  # failed: no first token, no timing
    assert book.speed("e") == pytest.approx(4020.0 / 2.02)


def test_work_queued_ahead_counts_toward_a_requests_wait() -> None:
    # Two prompts of 1,000 tokens sent together to an engine doing 1,000 tokens/s: the second waits for both.
    book = PrefillBook()
    first = book.start("e", 1000.0, 0.0, streamed=True)
    second = book.start("e", 1000.0, 0.0, streamed=True)
    book.first_token(first, 1.0)
    book.first_token(second, 2.0)
    assert book.speed("e") == pytest.approx(1000.0)  # (1,000 + 2,000) tokens over (1 + 2) s


def test_the_speed_follows_an_endpoint_that_changes_pace() -> None:
    rng = random.Random(3)
    book = PrefillBook()
    now = 0.0
    for rate in (1000.0, 4000.0):
        for _ in range(10 * SPEED_WINDOW):
            tokens = rng.uniform(100, 3000)
            now += 1.0
            book.first_token(book.start("e", tokens, now, streamed=True), now + tokens / rate)
        assert book.speed("e") == pytest.approx(rate, rel=0.05)
