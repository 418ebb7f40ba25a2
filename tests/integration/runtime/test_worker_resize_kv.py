"""A `kv_budget` command to a real worker process (`lorafn worker serve`, the real Engine on a tiny random
Llama, CPU, a real redis-server; docs/batch.md#kv-from-idle-memory): the worker resizes its KV cache between
steps while its requests run, answers `kv_resized`, and its heartbeat names the new grant
(`kv_budget_bytes`) and the larger `kv_bytes`; the requests that ran across the resize answer the same
greedy text as before it; a return to the start's budget when idle succeeds; a bad value is refused with a
reason and changes nothing."""

from __future__ import annotations

import uuid
from pathlib import Path

from lorafn.store import Keys, Store, control, workers
from tests.integration.gateway.harness import register, start_worker_process, stop_process, wait_live_workers
from tests.integration.runtime.test_worker_park import WAIT_S, _answer, _Events, _heartbeat, _send, _until

FN = "team-a/parking"  # the helpers of test_worker_park send to this function
MiB = 1 << 20


def test_a_worker_resizes_its_kv_cache_while_requests_run(
    redis_server: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [], model_dir=str(tiny_model_dir))
    wid = "resizing-worker-1"
    proc = start_worker_process(
        redis_server, prefix, FN, tmp_path / "worker.log",
        LORAFN_ENGINE_FACTORY="", LORAFN_WORKER_ID=wid, LORAFN_GPU="local/0", LORAFN_KEEP_ALIVE_SECONDS="600",
        LORAFN_DEVICE="cpu", LORAFN_KV_BUDGET_MIB="1",
    )  # fmt: skip
    prompts = [f"request {i}: the quick brown fox jumps over the lazy dog" for i in range(4)]
    try:
        wait_live_workers(None, store, keys, FN, 1, timeout=WAIT_S)
        for i, p in enumerate(prompts):
            _send(store, keys, f"before-{i}", p, max_tokens=48)
        before = [_answer(store, keys, f"before-{i}")[0] for i in range(4)]
        start_kv = int(_until("a heartbeat", lambda: _heartbeat(store, keys, wid).get("kv_bytes")))
        assert _heartbeat(store, keys, wid)["kv_budget_bytes"] == str(MiB)

        events = _Events(store, keys)
        for i, p in enumerate(prompts):
            _send(store, keys, f"across-{i}", p, max_tokens=48)
        store.run(workers.send_control(keys, wid, "kv_budget", bytes=4 * MiB))
        resized = events.next(control.KV_RESIZED, wid)
        assert resized["budget_bytes"] == str(4 * MiB) and resized["function"] == FN
        grown = int(resized["kv_bytes"])
        assert 3 * MiB < grown <= 4 * MiB and grown > start_kv
        across = [_answer(store, keys, f"across-{i}")[0] for i in range(4)]
        assert across == before  # the blocks in use kept their contents across the resize
        hb = _until(
            "a heartbeat with the grant",
            lambda: (h := _heartbeat(store, keys, wid)).get("kv_budget_bytes") == str(4 * MiB) and h,
        )
        assert int(hb["kv_bytes"]) == grown and hb["kv_grant"] == "1"

        store.run(workers.send_control(keys, wid, "kv_budget", bytes="lots"))
        refused = events.next(control.KV_RESIZE_REFUSED, wid)
        assert "bytes: 'lots' is not a positive integer" in refused["reason"]

        store.run(workers.send_control(keys, wid, "kv_budget", bytes=MiB))  # idle: back to the start's
        assert int(events.next(control.KV_RESIZED, wid)["kv_bytes"]) == start_kv
        _send(store, keys, "after", prompts[0], max_tokens=48)
        assert _answer(store, keys, "after")[0] == before[0]
        hb = _until(
            "a heartbeat without a grant",
            lambda: (h := _heartbeat(store, keys, wid)).get("kv_grant") == "0" and h,
        )
        assert hb["kv_budget_bytes"] == str(MiB)

        store.run(workers.send_control(keys, wid, "kv_budget", bytes=4 * MiB))  # granted again, then parked:
        assert int(events.next(control.KV_RESIZED, wid)["kv_bytes"]) == grown
        store.run(workers.send_control(keys, wid, "park"))  # the park gives the grant back first
        assert int(events.next(control.PARKED, wid)["released_bytes"]) == start_kv
        store.run(workers.send_control(keys, wid, "unpark"))
        assert int(events.next(control.UNPARKED, wid)["kv_bytes"]) == start_kv
        assert proc.poll() is None
    finally:
        code = stop_process(proc)
    assert code == 0, (tmp_path / "worker.log").read_text()[-3000:]
    assert f"worker {wid}: KV cache resized to {grown} bytes" in (tmp_path / "worker.log").read_text()
