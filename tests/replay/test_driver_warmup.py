"""The driver's clock with a warm-up, against the real gateway over HTTP (real redis-server, serving loops
in threads with the harness's deterministic engine): the warm-up is sent before 0, the measured window at
its own times, the same requests as a drive without a warm-up, and the samples run from the warm-up on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from lorafn.replay.driver import Drive, DriveOptions, Target, drive
from lorafn.replay.trace import PlannedRequest, PlanOptions, TraceRow, function_names, plan_requests
from lorafn.store import Keys, Store
from tests.integration.gateway.harness import gateway, register, worker_thread

PREFIX = "replaywarm"
FUNCTIONS = function_names(2)
KEYS = {fn: f"key-{i}" for i, fn in enumerate(FUNCTIONS)}
ROWS = [TraceRow(0.2 * i, 8 + i % 5, 3 + i % 4) for i in range(40)]
QUESTIONS = [f"question {i} about pears" for i in range(9)]
# 6 requests over 1.5 s from 2 s into the rows (every 0.2 s: ×1.25), and a 1 s warm-up: the 4 rows before
OPTIONS = PlanOptions(2, rate_rps=4.0, duration_s=1.5, trace_start_s=2.0, seed=3, max_output_tokens=4)
WARMUP_S = 1.0


@pytest.fixture
def platform(redis_server: str) -> Iterator[Target]:
    store, keys = Store(redis_server), Keys(PREFIX)
    for fn in FUNCTIONS:
        register(store, keys, fn, [KEYS[fn]])
    with (
        gateway(redis_server, PREFIX) as url,
        worker_thread(redis_server, PREFIX, FUNCTIONS[0]),
        worker_thread(redis_server, PREFIX, FUNCTIONS[1]),
    ):
        yield Target(url, KEYS, redis_server, PREFIX)


def _plan(warmup_s: float) -> list[PlannedRequest]:
    options = PlanOptions(**{**OPTIONS.__dict__, "warmup_s": warmup_s})
    return plan_requests(ROWS, QUESTIONS, FUNCTIONS, options)


def _drive(target: Target, warmup_s: float) -> Drive:
    plan = _plan(warmup_s)
    options = DriveOptions(request_timeout_s=30, drain_timeout_s=30, sample_interval_s=0.1)
    return asyncio.run(drive(plan, target, options, warmup_s=warmup_s))


def test_warmup_goes_first_and_the_window_is_sent_as_without_it(platform: Target) -> None:
    warmed, cold = _drive(platform, WARMUP_S), _drive(platform, 0.0)
    early = [r for r in warmed.results if r.warmup]
    window = [r for r in warmed.results if not r.warmup]
    assert len(early) == 4 and len(window) == len(cold.results) == 6
    assert all(r.ok for r in warmed.results + cold.results), [r.error for r in warmed.results]
    # the warm-up is sent in [-1, 0) at its planned times; the window from 0 on at its own
    for r in warmed.results:
        assert r.sent_s is not None and r.scheduled_s - 0.01 <= r.sent_s <= r.scheduled_s + 0.5
    assert early[0].sent_s is not None and early[0].sent_s < -0.5  # a second before the window
    assert all(-WARMUP_S <= r.scheduled_s < 0 for r in early) and all(r.scheduled_s >= 0 for r in window)
    # the window's requests are the cold drive's: function, time, and what was asked and answered
    same = [(r.index, r.function, r.scheduled_s, r.prompt_tokens, r.completion_tokens) for r in window]
    assert same == [(r.index, r.function, r.scheduled_s, r.prompt_tokens, r.completion_tokens)
                    for r in cold.results]  # fmt: skip
    # the sampler ran from the warm-up's start; the duration is the window's (0 to the last answer)
    times = [s.t_s for s in warmed.samples]
    assert min(times) < -0.5 and max(times) > 1.0
    assert window[-1].scheduled_s < warmed.duration_s < window[-1].scheduled_s + 5
    assert all(s.t_s >= 0 for s in cold.samples)


def test_the_driver_refuses_a_plan_before_the_warmups_start(platform: Target) -> None:
    with pytest.raises(ValueError, match=r"before the warm-up's start at -0\.5 s"):
        asyncio.run(drive(_plan(1.0), platform, DriveOptions(), warmup_s=0.5))
