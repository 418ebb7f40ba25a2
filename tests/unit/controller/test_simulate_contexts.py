"""The start-up model's term per live CUDA context (issue 16, parking): with parking ~58 worker processes
stay alive instead of ~41, and a fresh context is slower beside more contexts (bench/context_probe.py). The
``-ctx`` models add ``per_context_s`` per other live process on the GPU beyond the ~40 the replays were fitted
at; the models without it are unchanged whatever the count."""

from __future__ import annotations

import dataclasses

import pytest

from lorafn.controller.policy import PolicyConfig
from lorafn.controller.policy.actions import Start
from lorafn.controller.policy.simulate import (
    BACKBONE,
    MIN_PRE_RUNNER_S,
    SHAPE,
    STARTUP_MODELS,
    GiB,
    SimSetup,
    Simulation,
    StartupModel,
    _Worker,
)

CTX = StartupModel("t", base_s=0.3, per_running_s=0.05, per_start_s=0.2, fixed_s=1.0, per_context_s=0.01,
                   context_ref=40.0)  # fmt: skip


def test_the_context_term_is_relative_to_the_fits_own_count_and_floored():
    assert CTX.pre_runner_s(0, 0) == pytest.approx(0.3)  # no count given: the fit's own
    assert CTX.pre_runner_s(0, 0, 40) == pytest.approx(0.3)
    assert CTX.pre_runner_s(0, 0, 60) == pytest.approx(0.5)
    assert CTX.pre_runner_s(2, 1, 60) == pytest.approx(0.3 + 0.1 + 0.2 + 0.2)
    assert CTX.pre_runner_s(0, 0, 30) == pytest.approx(0.2)  # fewer contexts than the fit's: faster
    assert CTX.pre_runner_s(0, 0, 0) == pytest.approx(MIN_PRE_RUNNER_S)  # 0.3 - 0.4: floored
    assert CTX.start_s(0, 0, 60) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="per_context_s"):
        dataclasses.replace(CTX, per_context_s=-0.001)


def test_the_models_without_the_term_ignore_the_count_and_the_ctx_ones_extend_h100_conn1():
    for name in ("h100-conn1", "h100-default"):
        m = STARTUP_MODELS[name]
        for contexts in (0, 40, 60, 100):
            assert m.pre_runner_s(3, 2, contexts) == m.pre_runner_s(3, 2)
    conn1 = STARTUP_MODELS["h100-conn1"]
    for name in ("h100-conn1-ctx", "h100-conn1-ctx-hi"):
        m = STARTUP_MODELS[name]
        assert (m.base_s, m.per_running_s, m.per_start_s, m.fixed_s) == (
            conn1.base_s, conn1.per_running_s, conn1.per_start_s, conn1.fixed_s,
        )  # fmt: skip
        assert m.pre_runner_s(3, 2, 40) == pytest.approx(conn1.pre_runner_s(3, 2))
        assert m.pre_runner_s(3, 2, 60) > conn1.pre_runner_s(3, 2)
    # 20 more contexts: ~0.1 s (5.2 ms each, one connection) and ~0.28 s (14 ms, the 8-connection slope)
    assert STARTUP_MODELS["h100-conn1-ctx"].pre_runner_s(0, 0, 60) - conn1.base_s == pytest.approx(0.104)
    assert STARTUP_MODELS["h100-conn1-ctx-hi"].pre_runner_s(0, 0, 60) - conn1.base_s == pytest.approx(0.28)


def _start_beside(model: StartupModel, idle: int) -> float:
    """The pre_runner time of one fresh start on a GPU where ``idle`` other processes (parked bound workers)
    are alive: only the clock runs (no rounds, no arrivals)."""
    setup = SimSetup(idle + 1, startup=model, settle_s=0.0, tick_s=0.01)
    sim = Simulation(setup, PolicyConfig(park_idle=True), [(0.0, 0)])
    sim.now = 10.0
    for i in range(idle):
        w = _Worker(f"p{i}", "gpu0", "bound", sim.names[i + 1], started_at=0.0, ready_at=0.0)
        w.parked = True
        sim.workers[w.id] = w
    sim.apply([Start("gpu0", BACKBONE, SHAPE, sim.names[0], GiB, "test")])
    while any(w.state == "starting" for w in sim.workers.values()):
        assert sim.now < 100.0, "the start never finished"
        sim._progress()
        sim.now = round(sim.now + setup.tick_s, 9)
        sim._finish_starts()
    (started,) = [w for w in sim.workers.values() if w.fresh_for == sim.names[0]]
    return started.pre_s


@pytest.mark.parametrize("idle", [40, 60])
def test_a_fresh_start_takes_longer_beside_more_live_processes_with_the_term_only(idle):
    assert _start_beside(CTX, idle) == pytest.approx(CTX.pre_runner_s(0, 0, idle), abs=0.01 + 1e-9)
    plain = dataclasses.replace(CTX, per_context_s=0.0, context_ref=0.0)
    assert _start_beside(plain, idle) == pytest.approx(0.3, abs=0.01 + 1e-9)
    assert _start_beside(CTX, 60) > _start_beside(CTX, 40)
