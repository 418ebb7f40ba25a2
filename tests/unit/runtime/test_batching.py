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
