"""`worker.request_timing`: where one finished request spent its time (pure)."""

from __future__ import annotations

import pytest

from lorafn.runtime.worker import _Running, request_timing


def test_stages_from_enqueue_to_done() -> None:
    run = _Running("r", "1000-0", arrival_ms=1000.0, read_ms=1002.0, read_at=50.0)
    run.first_step_at, run.first_token_at, run.first_sent_ms = 50.004, 50.030, 1033.0
    assert request_timing(run, done_ms=1100.0) == pytest.approx(
        {"queued": 2.0, "held": 4.0, "prefill": 26.0, "first_token": 33.0, "total": 100.0}
    )


def test_a_request_that_never_ran_has_no_step_stages() -> None:
    run = _Running("r", "1000-0", arrival_ms=1000.0, read_ms=1001.0, read_at=5.0)
    assert request_timing(run, done_ms=1010.0) == {"queued": 1.0, "total": 10.0}


def test_the_gc_clock_counts_collections() -> None:
    import gc

    from lorafn.runtime.worker import GcClock

    clock = GcClock().install()
    try:
        before = clock.total_ms
        junk = [[i] for i in range(200_000)]  # something for a full collection to walk
        gc.collect()
        assert clock.total_ms > before
        del junk
    finally:
        gc.callbacks.remove(clock)


def test_settle_heap_freezes_what_is_alive() -> None:
    import gc

    from lorafn.runtime.standby import settle_heap

    try:
        assert settle_heap() >= 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # this test process keeps collecting as before
