"""Parking across the seam (issue 16, PARKING.md): `lorafn up` on CPU with `LORAFN_PARK_IDLE=true`, one
simulated device that holds two bound workers but not three (two bound and a parked one fit). Three functions
are called one after another: the third one's fresh start parks the idle worker of one of the first two (its
process stays: same worker id, same pid, no stop command), and that function's next request unparks it (the
parked worker records demand, the controller unparks it, after parking another idle worker for its KV) and it
answers. Asserted are behaviours (lifecycle events, control commands, pids, answers), not times.

Sizes: every function's KV cache is 128 MiB (`spec.resources`), a worker's overhead 16 MiB (the CPU has no
driver count: the controller charges the configured one), so a worker is charged ~144 MiB unparked and ~16
MiB parked (its charge less the KV bytes it reports releasing); the device's 406 MiB at 92% less the 4 MiB
backbone grant ~370 MiB: 2 x 144 fits, 3 x 144 does not, 2 x 144 + 16 does."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from lorafn.local.status import collect
from lorafn.replay.configs import ReplayConfig
from lorafn.replay.driver import DriveOptions, Target, drive
from lorafn.replay.platform import BACKBONE, FunctionSetup, ManagedPlatform, manifest, new_keys
from lorafn.replay.stats import RequestResult
from lorafn.replay.trace import PlannedRequest
from lorafn.store import control, workers
from tests.integration.runtime.engine_helpers import write_peft_adapter

pytestmark = pytest.mark.slow

F1, F2, F3 = "park/f1", "park/f2", "park/f3"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_third_function_parks_an_idle_worker_and_its_function_unparks_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    functions = [F1, F2, F3]
    adapters = [
        write_peft_adapter(
            tiny_model_dir, tmp_path / f"a{i}", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=i
        )
        for i in range(len(functions))
    ]
    settings = {
        "device": "cpu", "devices": 1, "device_memory_mib": 406, "worker_overhead_mib": 16,
        "warm_pool": False,  # every cold start is a fresh start: no standby holds memory
        "parked_keep_alive_s": "inf",  # up.yaml -> LocalConfig -> the controller's policy -> the park command
    }  # fmt: skip
    platform = ManagedPlatform(tmp_path / "up", settings, env={"LORAFN_PARK_IDLE": "true"})
    keys = new_keys(functions)
    setup = FunctionSetup(slo_ttft_ms=60_000, keep_alive_s=3600, max_replicas=1, kv_cache_mib=128)
    config = ReplayConfig("park", "tests/integration/local/test_park_local.py", warm_pool_fallback=(0, 0))
    try:
        state = platform.start(timeout_s=180)
        platform.apply(
            manifest(
                tiny_model_dir, "float32", functions, adapters, keys, setup, config, True, namespace="park"
            )
        )
        store = platform.store
        assert store is not None
        target = Target(state.gateway_url, keys, state.redis_url, state.key_prefix)
        options = DriveOptions(request_timeout_s=180, drain_timeout_s=180)
        calls = 0

        def call(fn: str) -> RequestResult:
            nonlocal calls
            calls += 1
            plan = [PlannedRequest(calls, 0.0, fn, "Hello there.", 4, 6)]
            (result,) = asyncio.run(drive(plan, target, options)).results
            assert result.ok and result.completion_tokens, (fn, result.error, platform.log_tail())
            return result

        def serving() -> dict[str, tuple[str, int, dict[str, str]]]:
            """function -> (worker id, pid, heartbeat) of its one worker (max_replicas 1)"""
            return {
                h["function"]: (wid, int(h["pid"]), h)
                for wid, h in platform.workers().items()
                if h.get("function") and h.get("state") != "standby"
            }

        def wait_until(what: str, check, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                platform.check_alive()
                got = check()
                if got:
                    return got
                time.sleep(0.2)
            raise AssertionError(f"timed out waiting for {what}:\n{platform.log_tail(60)}")

        def events(kind: str) -> list[dict[str, str]]:
            return [
                e for _id, e in store.run(control.read_events(platform.keys, "0-0")) if e.get("kind") == kind
            ]

        def commands(wid: str) -> list[str]:
            return [c["cmd"] for _id, c in store.run(workers.read_control(platform.keys, wid, "0-0"))]

        call(F1)
        call(F2)
        first = serving()
        assert set(first) == {F1, F2}
        # fresh workers (no warm pool) started with --function only heartbeat their registration's backbone,
        # the one the controller reads their private bytes and the replay their memory by
        assert {h.get("backbone") for _w, _p, h in first.values()} == {BACKBONE}
        assert events(control.PARKED) == []  # two fit: nothing parked yet

        call(F3)  # its fresh start fits only once one of the two idle workers is parked
        (parked,) = wait_until("a PARKED event", lambda: events(control.PARKED))
        victim = parked["function"]
        assert victim in (F1, F2)
        wid, pid, _ = first[victim]
        assert parked["worker"] == wid and int(parked["released_bytes"]) > 0
        # parked, not stopped: the same process, still its function's worker, told to park and nothing else
        beat = wait_until("its heartbeat saying parked", lambda: serving()[victim][2].get("parked") == "1")
        assert beat
        assert serving()[victim][:2] == (wid, pid) and _alive(pid)
        assert commands(wid) == ["park"]
        (park,) = [c for _id, c in store.run(workers.read_control(platform.keys, wid, "0-0"))]
        assert park.get("keep_alive_s") == "inf"  # the parked keep-alive travels in the command
        assert set(serving()) == {F1, F2, F3}
        shown = {w.id: w for w in collect(store, platform.keys).workers}  # what `lorafn status` shows
        assert shown[wid].parked and shown[wid].pid == str(pid)

        again = call(victim)  # the parked worker records demand; the controller unparks it; it answers
        assert again.cold is False  # its worker was live all along: no cold start
        unparked = [e for e in events(control.UNPARKED) if e["worker"] == wid]
        assert unparked and int(unparked[0]["kv_bytes"]) > 0
        assert commands(wid)[:2] == ["park", "unpark"] and "stop" not in commands(wid)
        assert serving()[victim][:2] == (wid, pid) and _alive(pid)
        # its KV did not fit beside the other two: another idle worker was parked for it, none stopped
        others = [e for e in events(control.PARKED) if e["worker"] != wid]
        assert others and {e["function"] for e in others} <= {F1, F2, F3} - {victim}
        now = serving()
        assert set(now) == {F1, F2, F3}
        assert all(_alive(p) for _w, p, _h in now.values())
        assert all("stop" not in commands(w) for w, _p, _h in now.values())
        print(
            f"parked {victim} ({wid}, pid {pid}) for {F3}, released {parked['released_bytes']} bytes; "
            f"unparked for its next request (KV {unparked[0]['kv_bytes']} bytes), parking "
            f"{others[0]['function']}"
        )
    finally:
        platform.stop()
