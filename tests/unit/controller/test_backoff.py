"""Failed starts back off exponentially: base, 2 base, 4 base, ... capped; deterministic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lorafn.controller.policy.backoff import backoff_delay_s, backoff_reason, backoff_remaining_s

from .helpers import fn


def test_schedule_doubles_then_caps():
    assert [backoff_delay_s(n, 2.0, 60.0) for n in range(8)] == [0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert backoff_delay_s(10**6, 2.0, 60.0) == 60.0


@given(st.integers(0, 200), st.floats(0, 100), st.floats(0, 1000))
def test_delay_is_monotone_and_bounded(n, base, cap):
    if base > cap:
        base, cap = cap, base
    d = backoff_delay_s(n, base, cap)
    assert 0.0 <= d <= cap
    assert backoff_delay_s(n + 1, base, cap) >= d


def test_remaining_counts_from_the_last_failure():
    f = fn("ns/f", start_failures=3, last_failure_s=5.0, last_failure="CUDA out of memory")
    assert backoff_remaining_s(f, 2.0, 60.0) == 3.0  # 8 s delay, 5 s gone
    assert backoff_remaining_s(fn("ns/f", start_failures=3, last_failure_s=9.0), 2.0, 60.0) == 0.0
    assert backoff_remaining_s(fn("ns/f"), 2.0, 60.0) == 0.0
    # the time of the failure was lost: wait the whole delay
    assert backoff_remaining_s(fn("ns/f", start_failures=1), 2.0, 60.0) == 2.0
    reason = backoff_reason(f, 3.0)
    assert reason.startswith("backing off after 3 failed starts: CUDA out of memory")
    assert "3.0 s" in reason


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="failures"):
        backoff_delay_s(-1, 1, 2)
