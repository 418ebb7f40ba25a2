"""Decode gating as real processes: `lorafn up` on CPU (one simulated device), admission and decode
gating on, a tight function (200 ms TTFT) and two loose ones (60 s); the loose ones stream long answers
while the tight one gets bursts of prompts. Asserted are behaviours, not times (this CPU is shared):
tight prefills were granted urgent, the loose workers paused decode steps for them (the GPU's gating
counters), the tight worker never paused, every pause ended either at the urgent step's end or at its
bound, and nothing was lost (every request answered in full, no entry left pending).

Why bursts behind a small prefill budget: a grant is urgent while its oldest waiting prompt is inside a
window, past `1 - f` of its SLO (f = `LORAFN_GATE_URGENT_FRACTION`, 0.9 here) and not yet late. A lone
prompt that a worker picks up in 1-3 ms never is (with one at a time and f = 0.5, a quiet CI machine
once ran ten, then twenty of them without one urgent grant). A burst of prompts that the GPU's budget
(`LORAFN_GPU_PREFILL_TOKENS`, below one prompt) lets in one chunk per step waits step after step, so the
worker's asks walk through the window (20 to 200 ms): on a fast machine after a few steps, on a loaded
one (asks ~100 ms apart were seen with two busy loops beside the test) still inside it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.admission import manifest
from lorafn.replay.driver import DriveOptions, Target, drive
from lorafn.replay.platform import ManagedPlatform, new_keys
from lorafn.replay.trace import PlannedRequest
from lorafn.store import admission as adm
from lorafn.store import streams
from tests.integration.runtime.engine_helpers import write_peft_adapter

pytestmark = pytest.mark.slow

TIGHT, LOOSE = "adm/tight", ("adm/loose-a", "adm/loose-b")
SLOS = {TIGHT: 200, LOOSE[0]: 60_000, LOOSE[1]: 60_000}  # loose: never urgent (a margin below 54 s)


def stream_id(entry_id: str) -> tuple[int, int]:
    """A Redis stream entry id ("ms-seq") as a tuple that orders as the stream does."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def test_loose_workers_pause_decodes_for_the_tight_prefills_and_lose_nothing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    functions = [TIGHT, *LOOSE]
    adapters = [
        write_peft_adapter(
            tiny_model_dir, tmp_path / f"a{i}", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=i
        )
        for i in range(len(functions))
    ]
    settings = {"device": "cpu", "devices": 1, "warm_pool": False, "gpu_admission": True}
    # a TPOT bound far above this CPU's step times: the pauses' bound is never what ends a test run early
    # a prefill budget below one tight prompt (~130 tokens): a burst is prefilled chunk by chunk, one per step
    env = {
        "LORAFN_DECODE_GATING": "true",
        "LORAFN_GATE_TPOT_MS": "2000",
        "LORAFN_GATE_URGENT_FRACTION": "0.9",
        "LORAFN_GPU_PREFILL_TOKENS": "48",
    }
    platform = ManagedPlatform(tmp_path / "up", settings, env=env)
    keys = new_keys(functions)
    try:
        state = platform.start(timeout_s=180)
        platform.apply(manifest(tiny_model_dir, "float32", functions, adapters, SLOS, keys))
        settled = platform.settle(functions, 1, want_standby=False, shared=True, timeout_s=240)
        assert settled.get("settled"), (settled, platform.log_tail())
        target = Target(state.gateway_url, keys, state.redis_url, state.key_prefix)
        options = DriveOptions(request_timeout_s=180, drain_timeout_s=180)
        # warm-up: every worker measures its prefill and decode steps (the profile bounds the pauses)
        warm = [PlannedRequest(i, 0.05 * i, fn, "Hello there.", 4, 12) for i, fn in enumerate(functions * 8)]
        assert all(r.ok for r in asyncio.run(drive(warm, target, options)).results)
        assert platform.store is not None
        before = platform.store.run(adm.gating_counters(platform.keys, "local/0"))
        # the warm-up's grants are in the log too (on a loaded machine some of them were urgent): only those
        # after its last one are the bursts', which the counters' difference counts
        warm_grants = platform.store.run(adm.grants(platform.keys, "local/0"))
        mark = stream_id(warm_grants[-1].entry_id) if warm_grants else (0, 0)
        prompt = "The quick brown fox jumps over the lazy dog. " * 12
        # the loose functions decode all along (a new long answer every 0.2 s); the tight one gets three
        # bursts of 8 prompts in between (see the module's docstring)
        plan = [PlannedRequest(i, 0.2 * i, LOOSE[i % 2], "Tell a long story.", 8, 120) for i in range(24)]
        bursts = [(24 + 8 * b + i, 0.8 + 1.2 * b) for b in range(3) for i in range(8)]
        plan += [PlannedRequest(i, at, TIGHT, prompt, 120, 4) for i, at in bursts]
        done = asyncio.run(drive(plan, target, options))
        assert all(r.ok for r in done.results), [r.error for r in done.results if not r.ok]
        assert all(r.completion_tokens for r in done.results)
        for fn in functions:  # nothing left pending
            assert platform.store.run(streams.pending(platform.keys, fn, 0)) == []
        grants = platform.store.run(adm.grants(platform.keys, "local/0"))
        after = platform.store.run(adm.gating_counters(platform.keys, "local/0"))
    finally:
        platform.stop()

    urgent = [g for g in grants if g.urgent]
    shown = [(g.function, g.margin_ms, g.active, g.urgent) for g in grants]
    assert urgent and {g.function for g in urgent} == {TIGHT}, shown  # only the tight SLO is ever urgent
    burst_urgent = [g for g in urgent if g.entry_id and stream_id(g.entry_id) > mark]
    assert after["urgent_grants"] - before["urgent_grants"] == len(burst_urgent), (before, after, shown)
    gated = after["gated_steps"] - before["gated_steps"]
    assert gated >= 1, after  # the loose workers paused decode steps for the tight prefills
    assert after.get(f"gated_steps|{TIGHT}", 0) == 0  # the urgent worker itself never pauses
    assert sum(after.get(f"gated_steps|{fn}", 0) for fn in LOOSE) == after["gated_steps"]
    assert after["gated_ms"] > 0 and after["timeouts"] <= after["gated_steps"]
    # each pause is bounded by the TPOT slack (< LORAFN_GATE_TPOT_MS = 2 s; plus its round trip): a loose
    # check of a bound the BLPOP timeout enforces, far from this CPU's step times
    assert after["gated_ms"] <= after["gated_steps"] * 3000
    print(
        f"urgent grants {len(urgent)}, gated steps {gated:.0f}, waited {after['gated_ms']:.0f} ms in all, "
        f"{after['timeouts']:.0f} ran to their bound"
    )
