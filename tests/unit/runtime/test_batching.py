"""The worker's SLO-aware batching state (lorafn.runtime.batching) without Redis: which steps are measured,
when the profile is published, the TPOT cap, fill-or-expire on a clock, and the switch from the worker's
settings and `lorafn up`'s config down to the serving loop."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from lorafn.runtime import slo
from lorafn.runtime.batching import Batching, BatchingConfig
from lorafn.runtime.worker import WorkerSettings, serving_config
from lorafn.store import Keys


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _batching(clock: Clock | None = None, **cfg: Any) -> Batching:
    config = BatchingConfig(
        **{"ttft_ms": 1000.0, "backbone": "tiny", "gpu": "local/0", "gpu_admission": True, **cfg}
    )
    return Batching(None, Keys("t"), "w-1", "ns/fn", config, clock=clock or Clock())  # type: ignore[arg-type]


def test_first_steps_are_not_measured_and_the_fit_is_published_every_n() -> None:
    b = _batching(warmup_steps=2, publish_every=4)
    for _ in range(2):
        b.observe((1, 0), 900.0)  # kernels loading: not the GPU's speed
    assert b.fit(slo.PREFILL) is None
    for n in (1, 2, 3, 4):
        b.observe((n, 3), 10.0 + 5.0 * (n - 1))  # a step with prefills is a prefill step
    fit = b.fit(slo.PREFILL)
    assert fit is not None and fit.latency_ms(3) == pytest.approx(20.0)
    assert b.fit(slo.DECODE) is None
    ops = b.pipeline_ops(busy=False)
    assert len(ops) == 1  # the profile (admission marks need a running batch)
    assert b.pipeline_ops(busy=False) == []
    b.observe((0, 0), 5.0)  # an empty step measures nothing
    assert b.profiles[slo.DECODE].samples == 0


def test_tpot_caps_the_running_batch() -> None:
    b = _batching(tpot_ms=30.0, warmup_steps=0)
    assert b.max_running(64) == 64  # not measured yet
    for n in (1, 4, 8):
        b.observe((0, n), 10.0 + 2.0 * (n - 1))
    assert b.max_running(64) == 11  # T(11) = 30 ms
    assert _batching(warmup_steps=0).max_running(64) == 64  # no tpotMs: no cap


def test_fill_or_expire_holds_only_when_companions_are_due() -> None:
    clock = Clock()
    b = _batching(clock, warmup_steps=0)
    b.profiles[slo.PREFILL].prior = slo.Fit(100.0, 10.0)  # B for 1000 ms: 64 (limit), T(8) = 170
    now_ms = time.time() * 1000
    b.arrived([now_ms], idle_before=True, limit=8)
    assert b.hold_left_ms(1) == 0  # the first arrival: no rate known, no hold
    b.arrived([now_ms], idle_before=False, limit=8)  # a companion at once: arrivals are dense
    b.arrived([now_ms], idle_before=True, limit=8)
    left = b.hold_left_ms(1)
    assert 0 < left <= 100  # SLO - T(N) - waited, and at most one lone prefill T(1)
    clock.t += 0.5 * left / 1000
    assert 0 < b.hold_left_ms(2) < left
    assert b.hold_left_ms(8) == 0  # the batch is full: go
    assert b.hold_left_ms(1) == 0  # and the hold is over
    off = _batching(clock, batch_hold=False)
    off.profiles[slo.PREFILL].prior = slo.Fit(100.0, 10.0)
    for _ in range(3):
        off.arrived([now_ms], idle_before=True, limit=8)
    assert off.hold_left_ms(1) == 0


def test_admission_needs_a_device_id_and_the_switch() -> None:
    class Engine:
        num_pending_prefills = 2

    assert _batching().gated(Engine())
    assert not _batching(gpu="").gated(Engine())
    assert not _batching(gpu_admission=False).gated(Engine())
    assert not _batching().gated(object())  # an engine that cannot hold its prefills back
    assert _batching(gpu_admission=False).allow_prefill(Engine(), {}) is True  # asks nothing


def test_the_switch_reaches_the_serving_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAFN_GPU_ADMISSION", "true")
    settings = WorkerSettings(function="ns/fn", gpu="local/0", backbone="tiny")
    cfg = serving_config(settings, "ns/fn", None, object()).batching
    assert (cfg.gpu_admission, cfg.batch_hold, cfg.gpu, cfg.backbone, cfg.gpu_model) == (
        True, True, "local/0", "tiny", "cpu",
    )  # fmt: skip
    monkeypatch.delenv("LORAFN_GPU_ADMISSION")
    # opt-in: off unless switched on (it raised TTFT on the H100, docs/benchmarks.md)
    assert not serving_config(
        WorkerSettings(function="ns/fn"), "ns/fn", None, object()
    ).batching.gpu_admission


@pytest.mark.parametrize("on", [True, False])
def test_lorafn_up_passes_its_switch_to_workers(tmp_path: Path, on: bool) -> None:
    from lorafn.local.config import LocalConfig
    from lorafn.local.platform import LocalPlatform

    platform = LocalPlatform(LocalConfig(state_dir=tmp_path, device="cpu", gpu_admission=on))
    assert platform.executor.worker_extra_env["LORAFN_GPU_ADMISSION"] == ("true" if on else "false")


class _Out:
    def __init__(self, n: int) -> None:
        self.prompt_token_ids = list(range(n))


class _Engine:
    """What `Batching` reads of an engine: pending prefills, prompts, the step's token budget."""

    class config:  # the engine's attribute (EngineConfig)
        max_num_batched_tokens = 512

    def __init__(self, prompts: dict[str, int]) -> None:
        self.prompts = prompts
        self.num_pending_prefills = len(prompts)

    def get_output(self, rid: str) -> _Out | None:
        return _Out(self.prompts[rid]) if rid in self.prompts else None


def test_a_step_asks_for_its_prompt_tokens_within_the_step_budget() -> None:
    b = _batching()
    assert b.prefill_tokens(_Engine({"a": 100, "b": 50}), ["a", "b"]) == 150
    assert b.prefill_tokens(_Engine({"a": 400, "b": 300}), ["a", "b"]) == 512  # one step's worth at most
    assert b.prefill_tokens(_Engine({}), ["gone"]) == 1
    assert b.prefill_tokens(object(), ["a"]) == b.config.prefill_tokens  # unknown: the whole budget


def test_a_granted_step_that_prefilled_nothing_stops_the_asking_until_a_request_ends() -> None:
    clock = Clock()
    b = _batching(clock, blocked_recheck_ms=2000.0)  # no store: an ask would fail on None
    engine = _Engine({"w": 300})
    b._holds_slot = True  # the share was granted for this step
    b.after_step((0, 2), 10.0, {"r1", "r2", "w"})  # two decodes ran, the waiting one could not start
    assert len(b.pipeline_ops(busy=True)) >= 1  # the release (and the active mark)
    waiting = {"w": time.time() * 1000}
    for _ in range(5):  # decode steps: not one ask
        assert b.allow_prefill(engine, waiting, {"r1", "r2", "w"}) is False
    with pytest.raises(AttributeError):  # r1 ended: it asks again (here: no store to ask)
        b.allow_prefill(engine, waiting, {"r2", "w"})
    b._blocked, b._blocked_at = frozenset({"r1", "r2", "w"}), clock.t
    clock.t += 2.5  # the recheck: it asks again even though nothing ended
    with pytest.raises(AttributeError):
        b.allow_prefill(engine, waiting, {"r1", "r2", "w"})
    b._blocked, b._blocked_at = frozenset({"w"}), clock.t
    with pytest.raises(AttributeError):  # nothing to decode: it must ask (nothing else would free it)
        b.allow_prefill(engine, waiting, {"w"})


def test_decode_gating_switch_reaches_the_serving_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAFN_GPU_ADMISSION", "true")
    monkeypatch.setenv("LORAFN_DECODE_GATING", "true")
    monkeypatch.setenv("LORAFN_GATE_TPOT_MS", "150")
    monkeypatch.setenv("LORAFN_GATE_URGENT_FRACTION", "0.9")
    settings = WorkerSettings(function="ns/fn", gpu="local/0", backbone="tiny")
    cfg = serving_config(settings, "ns/fn", None, object()).batching
    assert (cfg.decode_gating, cfg.gate_tpot_ms, cfg.urgent_fraction) == (True, 150.0, 0.9)
    monkeypatch.setenv("LORAFN_GATE_URGENT_FRACTION", "1.5")
    with pytest.raises(ValueError, match="gate_urgent_fraction"):
        WorkerSettings(function="ns/fn")
    monkeypatch.delenv("LORAFN_GATE_URGENT_FRACTION")
    monkeypatch.delenv("LORAFN_DECODE_GATING")
    assert not serving_config(
        WorkerSettings(function="ns/fn"), "ns/fn", None, object()
    ).batching.decode_gating
    assert not _batching(decode_gating=True, gpu_admission=False).gating_on  # gating rides on admission
    with pytest.raises(ValueError, match="urgent_fraction"):
        BatchingConfig(urgent_fraction=2.0)


def test_the_urgent_grants_are_read_only_while_other_workers_are_active() -> None:
    b = _batching(decode_gating=True)
    b._saw_active(1)  # alone on its GPU (the active mark's answer)
    for _ in range(5):  # decode steps: nothing gating-related rides on the round trip
        b.pipeline_ops(busy=True)
    assert b.urgent_reads == 0
    b._saw_active(3)
    n = len(b.pipeline_ops(busy=True))
    assert b.urgent_reads == 1
    b._saw_active(1)
    assert len(b.pipeline_ops(busy=True)) == n - 1 and b.urgent_reads == 1
    off = _batching()  # admission without gating never reads them
    off._saw_active(3)
    off.pipeline_ops(busy=True)
    assert off.urgent_reads == 0
    # nothing seen: the loop's pause is a no-op without a store
    b.pause_decodes(lambda: 4)
    assert b.gate.gated_steps == 0


# ---------------------------------------------------------------------------- the bid's deadline (issue 13)


class _PlanEngine:
    """What `Batching` reads of an engine, over the real `Scheduler` with deadline order: requests get the
    worker's deadline (enqueue time + TTFT SLO, unix seconds) as `Worker` sets them on the engine."""

    class config:
        max_num_batched_tokens = 512

    def __init__(self, ttft_ms: float, deadline_order: bool = True) -> None:
        from lorafn.runtime.scheduler import Scheduler, SchedulerConfig

        self.ttft_ms = ttft_ms
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=512, block_size=4, num_blocks=256,
                deadline_order=deadline_order, prefill_s_per_token=0.001,
            )
        )  # fmt: skip
        self.enqueued: dict[str, float] = {}

    def add(self, rid: str, prompt: int, enqueued_ms: float) -> None:
        from lorafn.runtime.sampling_params import SamplingParams
        from lorafn.runtime.sequence import Sequence

        self.scheduler.add(Sequence(rid, [1] * prompt, SamplingParams(max_tokens=4)))
        self.scheduler.set_deadline(rid, (enqueued_ms + self.ttft_ms) / 1000)
        self.enqueued[rid] = enqueued_ms

    @property
    def num_pending_prefills(self) -> int:
        return self.scheduler.num_pending_prefills

    @property
    def num_pending_online_prefills(self) -> int:
        return self.scheduler.num_pending_online_prefills

    def pending_prefill_tokens(self, ids: Any = None) -> int:
        return self.scheduler.pending_prefill_tokens(ids)

    def priority_of(self, rid: str) -> int:
        return 0

    def next_prefill_deadline(self) -> float | None:  # as Engine's: the scheduler's, at unix now
        if not self.scheduler.config.deadline_order:
            return None
        return self.scheduler.next_prefill_deadline(time.time())


@pytest.mark.parametrize("rule", ["plan", "oldest"])
def test_the_bid_is_the_deadline_of_the_plans_first_on_time_prompt(redis_server: str, rule: str) -> None:
    """Worker `a` has a request already late (arrived 61 s ago, SLO 60 s: the plan serves it behind) and one
    that can still make it (60 s left); worker `b` one prompt with 5 s left; a third worker holds the whole
    budget. With the plan's deadline `a` bids ~60 s, both wait, and `b` gets the freed budget first; with
    the oldest request's, `a` bids -1 s and is granted at once, over the budget, for a request no grant
    saves."""
    from lorafn.store import Store
    from lorafn.store import admission as adm

    store, keys = Store(redis_server), Keys("bid")
    now_ms = time.time() * 1000
    ttft = 60_000.0
    a, b = _PlanEngine(ttft), _PlanEngine(ttft)
    a.add("late", 100, now_ms - 61_000)
    a.add("fresh", 100, now_ms)
    b.add("b1", 100, now_ms - 55_000)
    cfg = dict(ttft_ms=ttft, gpu="g0", gpu_admission=True, prefill_tokens=256, bid_deadline=rule)
    wa = Batching(store, keys, "w-a", "ns/a", BatchingConfig(**cfg))  # type: ignore[arg-type]
    wb = Batching(store, keys, "w-b", "ns/b", BatchingConfig(**cfg))  # type: ignore[arg-type]
    holder = adm.ask(
        keys, "g0", "w-c", "ns/c", deadline_ms=now_ms + 1e6, t_ms=0, lease_ms=60_000, waiter_ttl_ms=60_000,
        active_ttl_ms=60_000, budget=256, tokens=256,
    )  # fmt: skip
    assert store.run(holder).granted
    granted_a = wa.allow_prefill(a, a.enqueued, a.enqueued)
    assert wb.allow_prefill(b, b.enqueued, b.enqueued) is False  # 5 s left: it waits for the budget
    if rule == "oldest":
        # a margin below the expected wait (here 0: the holder's step time is unknown) goes at once, over
        # the budget: the late request's -1 s takes the GPU although no grant makes it on time
        assert granted_a is True
        grant = store.run(adm.grants(keys, "g0"))[-1]
        assert grant.worker == "w-a" and grant.margin_ms < 0
        return
    assert granted_a is False  # "fresh"'s deadline: 60 s to spare, it waits
    assert a.next_prefill_deadline() == pytest.approx((now_ms + ttft) / 1000)
    store.run(adm.release(keys, "g0", "w-c", active_ttl_ms=60_000, budget=256))  # handed to the best waiter
    first = store.run(adm.grants(keys, "g0"))[-1]
    assert first.worker == "w-b" and 0 < first.margin_ms < 5_000
    assert first.runner_up_ms is not None and first.runner_up_ms > 50_000  # a's bid: "fresh"'s deadline
    assert wb.allow_prefill(b, b.enqueued, b.enqueued) is True  # the handed share is its own


def test_the_bid_is_the_oldest_request_when_nothing_is_on_time_or_the_order_is_off(redis_server: str) -> None:
    from lorafn.store import Store
    from lorafn.store import admission as adm

    store, keys = Store(redis_server), Keys("bid2")
    now_ms = time.time() * 1000
    for n, engine in enumerate((_PlanEngine(60_000.0), _PlanEngine(60_000.0, deadline_order=False))):
        engine.add("late", 100, now_ms - 61_000)  # nothing on time / first come first served ...
        engine.add("later", 100, now_ms - 60_500)
        if n == 1:
            engine.add("fresh", 100, now_ms)  # ... even with one that could make it
        cfg = BatchingConfig(ttft_ms=60_000.0, gpu=f"g{n}", gpu_admission=True, prefill_tokens=512)
        assert cfg.bid_deadline == "plan"  # the default
        w = Batching(store, keys, f"w{n}", "ns/a", cfg)
        assert w.allow_prefill(engine, engine.enqueued, engine.enqueued) is True
        grant = store.run(adm.grants(keys, f"g{n}"))[-1]
        assert -2_000 < grant.margin_ms < -1_000 + 1  # the oldest request's deadline: 1 s ago
    with pytest.raises(ValueError, match="bid_deadline"):
        BatchingConfig(bid_deadline="newest")


def test_the_bid_rule_reaches_the_serving_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (
        serving_config(WorkerSettings(function="ns/fn"), "ns/fn", None, object()).batching.bid_deadline
        == "plan"
    )
    monkeypatch.setenv("LORAFN_BID_DEADLINE", "oldest")
    assert (
        serving_config(WorkerSettings(function="ns/fn"), "ns/fn", None, object()).batching.bid_deadline
        == "oldest"
    )
    monkeypatch.setenv("LORAFN_BID_DEADLINE", "newest")
    with pytest.raises(ValueError, match="bid_deadline"):
        WorkerSettings(function="ns/fn")


def test_bid_deadline_rule_by_example() -> None:
    from lorafn.runtime.batching import bid_deadline_ms

    assert bid_deadline_ms("plan", 1_000.0, 500.0, 7.0) == 7_000.0  # the plan's on-time prompt
    assert bid_deadline_ms("plan", 1_000.0, 500.0, None) == 1_500.0  # nothing on time: the oldest's
    assert bid_deadline_ms("oldest", 1_000.0, 500.0, 7.0) == 1_500.0
    with pytest.raises(ValueError, match="bid deadline"):
        bid_deadline_ms("fifo", 1_000.0, 500.0, None)
