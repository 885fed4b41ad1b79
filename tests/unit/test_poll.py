"""The waits between looks: growing from 50 ms to 0.5 s while nothing comes, and at most a tenth
of the last cycle once cycles are short (a colocated step of a fraction of a second)."""

import time

import pytest

from relax_hpc.metrics.poll import Poll


def test_looks_back_off_to_half_a_second_before_any_cycle():
    poll = Poll()
    waits = [poll.interval() for _ in range(10)]
    assert waits[:3] == pytest.approx([0.05, 0.075, 0.1125])
    assert waits[-1] == 0.5 and waits == sorted(waits)


def test_a_short_cycle_caps_the_waits_at_a_tenth_of_it():
    poll = Poll()
    time.sleep(0.2)
    poll.progressed()  # a cycle of ~0.2 s: looks at most every ~20 ms
    waits = [poll.interval() for _ in range(10)]
    assert 0.02 <= poll.cap < 0.05 and max(waits) == poll.cap and waits[0] <= poll.cap
    poll.progressed()  # a cycle of almost nothing: the floor, 10 ms
    assert poll.cap == 0.01 and poll.interval() == 0.01


def test_a_lower_ceiling_holds_before_and_after_cycles():
    poll = Poll(highest=0.2)  # the driver's: a run's first batch waits for the engines to register
    assert max(poll.interval() for _ in range(10)) == 0.2
    time.sleep(0.05)
    poll.progressed()
    assert 0.01 <= poll.cap < 0.02  # a tenth of ~50 ms is under the 10 ms floor
