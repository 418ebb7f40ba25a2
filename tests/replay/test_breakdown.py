"""bench/replay_breakdown.py's decode-concurrency figure (section 5): which functions were generating
tokens at once, and TPOT binned by that count (pure arithmetic over replay.json's request records)."""

from __future__ import annotations

import pytest

from bench.replay_breakdown import decoding_functions, tpot_by_decoding_functions


def _req(fn: str, sent: float, ttft_ms: float, e2e_ms: float, tpot_ms: float | None = 10.0) -> dict:
    return {"function": fn, "sent_s": sent, "ttft_ms": ttft_ms, "e2e_ms": e2e_ms, "tpot_ms": tpot_ms}


def test_counts_distinct_functions_decoding_at_the_middle_of_each_decode() -> None:
    reqs = [
        _req("a", 0.0, 100, 2100),  # decodes 0.1-2.1 s, middle 1.1
        _req("a", 0.5, 100, 1500),  # same function: counted once
        _req("b", 1.0, 50, 1050),  # decodes 1.05-2.05, middle 1.55
        _req("c", 5.0, 100, 1100),  # alone, 5.1-6.1
        _req("d", 0.0, 3000, 3000, tpot_ms=None),  # one token: no decode phase, no TPOT
        {"function": "e", "sent_s": 0.0, "ttft_ms": None, "e2e_ms": 900.0, "tpot_ms": None, "error": "x"},
    ]
    got = [(r["function"], r["sent_s"], n) for r, n in decoding_functions(reqs)]
    # a@0: at 1.1 s a (both) and b (from 1.05) decode -> 2; a@0.5 middle 1.3 -> 2; b middle 1.55 -> 2; c -> 1
    assert got == [("a", 0.0, 2), ("a", 0.5, 2), ("b", 1.0, 2), ("c", 5.0, 1)]


def test_tpot_bins_and_the_time_each_decoding_function_adds() -> None:
    reqs = [_req(f"f{i}", 0.0, 100, 10100, tpot_ms=70.0) for i in range(10)]  # 10 functions at once
    reqs += [_req("solo", 100.0, 100, 1100, tpot_ms=8.0)]
    rows = tpot_by_decoding_functions(reqs, width=5)
    assert rows == [(1, 1, 8.0, 8.0), (6, 10, 70.0, pytest.approx(7.0))]
