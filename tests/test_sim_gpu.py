"""The simulated GPU's utilisation: a trailing window like NVML's, the same whoever reads it and how often."""

from __future__ import annotations

import pytest

from worker.sim.gpu import UTILISATION_WINDOW, BusyWindow


def half_busy(window: BusyWindow, start: float, seconds: float, step: float = 0.01) -> float:
    """Alternate busy and idle steps from `start`: 50% utilisation. Returns the end time."""
    t = start
    for i in range(round(seconds / step)):
        if i % 2 == 0:
            window.busy(t, step)
        t += step
    return t


def test_utilisation_is_the_busy_fraction_of_exactly_the_last_window() -> None:
    w = BusyWindow(0.0)
    assert w.fraction(5.0) == 0.0  # idle for a while
    end = half_busy(w, 5.0, 2 * UTILISATION_WINDOW)
    assert w.fraction(end) == pytest.approx(0.5, abs=0.01)
    w.busy(end, UTILISATION_WINDOW)  # one long step covering the next window
    assert w.fraction(end + UTILISATION_WINDOW) == pytest.approx(1.0)
    assert w.fraction(end + 3 * UTILISATION_WINDOW) == 0.0  # nothing in the last window
    assert w.total == pytest.approx(UTILISATION_WINDOW + UTILISATION_WINDOW)


@pytest.mark.parametrize("reads_per_window", [0.25, 1, 10, 500])
def test_how_often_anyone_reads_does_not_change_what_is_read(reads_per_window: float) -> None:
    # The agent samples once per interval, a load-test harness maybe far more often, or far less. NVML's
    # window is the driver's, not the reader's: every reader sees the busy fraction of the last window.
    w = BusyWindow(0.0)
    step, every = 0.004, UTILISATION_WINDOW / reads_per_window
    readings, next_read, t = [], every, 0.0
    for i in range(round(20 * UTILISATION_WINDOW / step)):  # the engine runs; readers read as time passes
        if i % 2 == 0:
            w.busy(t, step)
        t += step
        if t >= next_read:
            if t > UTILISATION_WINDOW:
                readings.append(w.fraction(t))
            next_read += every
    assert readings and all(r == pytest.approx(0.5, abs=0.02) for r in readings)


def test_a_slowed_step_counts_its_whole_slowed_length() -> None:
    w = BusyWindow(0.0)
    w.busy(0.0, 0.02 * 4)  # a 20 ms step on a GPU slowed 4x
    assert w.total == pytest.approx(0.08) and w.fraction(0.08) == pytest.approx(1.0)


def test_busy_seconds_so_far_count_only_the_done_part_of_a_running_step() -> None:
    w = BusyWindow(0.0)
    w.busy(0.0, 0.1)
    w.busy(0.1, 0.4)  # a long prefill step, still running at 0.3
    assert w.total_at(0.3) == pytest.approx(0.3) and w.total_at(1.0) == pytest.approx(0.5)
