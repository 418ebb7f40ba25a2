"""A worker holds no more requests than its KV cache is expected to serve at once (runtime.read_cap), with a
real worker process (tiny Llama, CPU, a 1 MiB KV budget = 496 tokens, expected 200 tokens a request: it holds
two) and a real redis-server: of six requests sent at once, the rest stay queued in the function's stream
(where the controller counts them) and are read as the first ones finish; every request is answered. With
`LORAFN_KV_READ_CAP=false` the same worker takes all six at once (the behaviour before)."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest

from lorafn.store import Keys, Store, control, workers
from tests.integration.gateway.harness import register, start_worker_process, stop_process, wait_live_workers
from tests.integration.runtime.test_worker_park import WAIT_S, _answer, _send

FN = "team-a/parking"  # the helpers of test_worker_park send to this function


def _most_held(
    redis_server: str, tiny_model_dir: Path, tmp_path: Path, cap: str
) -> tuple[int, dict[str, str]]:
    """Send six requests at once; the most the worker held at one time (delivered, not acknowledged), and
    its first heartbeat."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [], model_dir=str(tiny_model_dir))
    proc = start_worker_process(
        redis_server, prefix, FN, tmp_path / f"worker-{cap}.log",
        LORAFN_ENGINE_FACTORY="", LORAFN_WORKER_ID=f"capped-{cap}", LORAFN_GPU="local/0", LORAFN_DEVICE="cpu",
        LORAFN_KEEP_ALIVE_SECONDS="600", LORAFN_KV_BUDGET_MIB="1", LORAFN_KV_READ_CAP=cap,
        LORAFN_EXPECTED_TOKENS_PRIOR="200",
    )  # fmt: skip
    most, done = 0, threading.Event()

    def watch() -> None:
        nonlocal most
        watcher = Store(redis_server)
        while not done.is_set():
            most = max(most, watcher.run(control.queue_depths(keys, [FN]))[FN].pending)
        watcher.close()

    try:
        wait_live_workers(None, store, keys, FN, 1, timeout=WAIT_S)
        beat = store.run(workers.worker_info(keys, [f"capped-{cap}"]))[f"capped-{cap}"]
        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        for i in range(6):
            _send(store, keys, f"r{i}", f"request {i}: the quick brown fox", max_tokens=48)
        answers = [_answer(store, keys, f"r{i}") for i in range(6)]
        done.set()
        thread.join(5)
        assert all(d.completion_tokens == 48 for _, d in answers)
    finally:
        done.set()
        code = stop_process(proc)
    assert code == 0, (tmp_path / f"worker-{cap}.log").read_text()[-3000:]
    return most, beat


@pytest.mark.parametrize(("cap", "bound"), [("true", 3), ("false", 6)])
def test_a_worker_holds_what_its_kv_cache_serves(
    redis_server: str, tiny_model_dir: Path, tmp_path: Path, cap: str, bound: int
) -> None:
    most, beat = _most_held(redis_server, tiny_model_dir, tmp_path, cap)
    if cap == "true":
        # 496 / 200 = 2 at first; 3 once three answers (~12 + 48 / 2 tokens held) pulled it to ~155
        assert 1 <= most <= bound
        # the heartbeat says what bounds it: its KV (2 requests) below its slots (max_running 64), which is
        # what the controller's burst KV grant needs to know (controller.snapshot: kv_limited)
        assert (beat["kv_cap"], beat["slot_cap"]) == ("2", "64"), beat
    else:
        assert most == bound
        assert beat["slot_cap"] == "64" and "kv_cap" not in beat, beat
