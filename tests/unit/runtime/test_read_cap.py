"""The worker's read cap (runtime.read_cap): it holds no more requests than its KV cache is expected to serve
at once, at least one; the expectation follows finished requests from its prior."""

from __future__ import annotations

import pytest

from lorafn.runtime.read_cap import ExpectedTokens, held_cap


@pytest.mark.parametrize(
    ("capacity", "expected", "cap"),
    [(1008, 250.0, 4), (1008, 1200.0, 1), (32768, 356.0, 92), (0, 250.0, 1), (496, 256.0, 1)],
)
def test_held_cap(capacity: int, expected: float, cap: int) -> None:
    assert held_cap(capacity, expected) == cap


def test_expected_tokens_follow_finished_requests() -> None:
    e = ExpectedTokens(200.0, weight=0.1)
    e.add(40, 40)  # held 40 + 20 on average
    assert e.value == pytest.approx(186.0)
    for _ in range(100):
        e.add(40, 40)
    assert e.value == pytest.approx(60.0, abs=0.1)
    e.add(0, 0)  # nothing known: unchanged
    assert e.value == pytest.approx(60.0, abs=0.1)
    with pytest.raises(ValueError, match="expected tokens must be > 0"):
        ExpectedTokens(0.0)
