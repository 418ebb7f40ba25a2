"""KV for bursts in the policy simulator (`PolicyConfig.burst_kv_bytes`, `SimSetup.kv_bytes`): a worker's
batch follows its KV; a grant is held (and charged) at once and serves a larger batch from ``resize_s`` later;
it goes back once the worker has been idle ``kv_grant_idle_s``; a burst behind one busy worker is served
sooner with grants than without. (The driver applies them: tests/unit/controller/test_burst_kv_driver.py.)"""

from __future__ import annotations

import statistics

from lorafn.controller.policy import PolicyConfig
from lorafn.controller.policy.actions import ResizeKV
from lorafn.controller.policy.simulate import SimSetup, Simulation

MiB = 1 << 20
GiB = 1 << 30
# one function; its worker serves 2 requests at once in 512 MiB of KV, 3 s each
SETUP = SimSetup(
    1, worker_bytes=2 * GiB, max_batch=2, service_s=3.0, kv_bytes=512 * MiB, resize_s=0.03, max_replicas=1,
    fresh_start_s=1.0, initial_fresh_start_s=1.0, min_standby=0, max_standby=0,
)  # fmt: skip
# a first request starts the worker; 8 more arrive together 10 s later, while it is warm
ARRIVALS = [(0.0, 0)] + [(10.0, 0)] * 8


def run(config: PolicyConfig) -> tuple[Simulation, list[float]]:
    sim = Simulation(SETUP, config, ARRIVALS)
    result = sim.run(drain_s=30.0)
    assert result.unanswered == 0
    return sim, result.ttft_s[1:]  # the burst's


def test_a_burst_is_served_sooner_with_a_kv_grant_and_the_grant_goes_back() -> None:
    _, without = run(PolicyConfig(warm_pool=False))
    sim, with_grant = run(PolicyConfig(warm_pool=False, burst_kv_bytes=2 * GiB))
    # without: two at a time, 3 s each: the last pair waits ~9 s; with: one grant serves the rest at once
    assert max(without) > 8.5 and max(with_grant) < 1.0, (without, with_grant)
    assert statistics.mean(with_grant) < statistics.mean(without) / 4
    assert sim.counts["kv_grants"] == 1
    (w,) = [w for w in sim.workers.values() if w.state == "bound"]
    assert w.kv == 0 and sim.batch_of(w) == 2  # idle kv_grant_idle_s after the burst: its own KV again


def test_a_grant_is_held_at_once_and_batches_from_the_resize_on() -> None:
    sim, _ = run(PolicyConfig(warm_pool=False))
    (w,) = [w for w in sim.workers.values() if w.state == "bound"]
    held = sim.held_bytes(w)
    sim.apply([ResizeKV(w.id, w.function or "", w.gpu, 2 * GiB, 2 * GiB - 512 * MiB)])
    assert sim.held_bytes(w) == held + 2 * GiB - 512 * MiB
    assert sim.snapshot().workers[0].kv_grant and sim.snapshot().workers[0].kv_bytes == 2 * GiB
    assert sim.batch_of(w) == 2  # not resized yet
    sim.now += 0.05
    assert sim.batch_of(w) == 8
    sim.apply([ResizeKV(w.id, w.function or "", w.gpu, 512 * MiB, 512 * MiB - 2 * GiB)])
    assert sim.held_bytes(w) == held and sim.batch_of(w) == 2 and not sim.snapshot().workers[0].kv_grant
