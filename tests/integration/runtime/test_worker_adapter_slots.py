"""A worker with adapter slots serves several functions of one namespace from one engine (issue 13,
docs/runtime.md#adapter-slots), with a real redis-server, the gateway over real HTTP and the `openai`
client, and the real Engine on a tiny Llama with real PEFT adapters (CPU, fp32):

- bound to one function, a `bind` command for another function of its namespace makes it join: a free slot
  gets the adapter, a `bound` lifecycle event with path "join" follows, and the worker is registered under
  both functions (the gateway's view); requests of both functions, sent at once, are answered with the
  tokens of each function's own one-adapter engine;
- a bind it cannot take is refused with a `bind_failed` event naming why (another namespace, no free slot),
  and the functions it serves keep being served;
- a joined function idle past its keep-alive leaves: its slot is emptied and the worker no longer counts as
  its worker, while the first function stays.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from lorafn.store import Keys, Store, control, workers
from tests.integration.gateway.harness import gateway, register, worker_thread
from tests.integration.runtime.engine_helpers import write_peft_adapter
from tests.waits import until as _until

FIRST, SECOND, THIRD, OTHER_NS = "team-a/first", "team-a/second", "team-a/third", "team-b/other"
KEYS = {FIRST: "sk-slots-first-0123", SECOND: "sk-slots-second-012", THIRD: "sk-slots-third-0123"}
PROMPTS = ["The quick brown fox", "one two three four five", "lorafn serves", "Hello"]
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    kw: dict[str, Any] = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
    return {
        FIRST: write_peft_adapter(llama_dir, root / "first", seed=11, **kw),
        SECOND: write_peft_adapter(llama_dir, root / "second", seed=12, **kw),
        THIRD: write_peft_adapter(llama_dir, root / "third", seed=13, **kw),
        OTHER_NS: write_peft_adapter(llama_dir, root / "other", seed=14, **kw),
    }


def _greedy(llama_dir: Path, adapter: Path) -> list[str]:
    engine = Engine(EngineConfig(model=llama_dir, adapter=adapter, device="cpu", dtype="float32"))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    return [o.text for o in engine.generate(PROMPTS, params)]


def _register_all(store: Store, keys: Keys, llama_dir: Path, adapters: dict[str, Path]) -> None:
    for function, path in adapters.items():
        keep_alive = 1 if function == SECOND else 60
        spec = {
            "backbone": "tiny",
            "adapter": {"uri": f"file://{path}"},
            "scaling": {"keepAliveSeconds": keep_alive},
        }
        key = KEYS.get(function, "sk-slots-other-0123")
        register(store, keys, function, [key], model_dir=str(llama_dir), adapter_dir=str(path), spec=spec)


def _events(store: Store, keys: Keys, function: str) -> list[dict[str, str]]:
    return [e for _, e in store.run(control.read_events(keys, "0")) if e.get("function") == function]


def _live(store: Store, keys: Keys, function: str) -> list[str]:
    now_ms = store.run(workers.server_time_ms())
    return store.run(workers.live_workers(keys, function, 5000, now_ms))


def test_functions_join_a_slot_worker_and_answer_as_their_own(
    redis_server: str, llama_dir: Path, adapters: dict[str, Path]
) -> None:
    references = {f: _greedy(llama_dir, adapters[f]) for f in (FIRST, SECOND)}
    assert references[FIRST] != references[SECOND]  # else equality could not show each kept its adapter
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    _register_all(store, keys, llama_dir, adapters)
    engine = Engine(
        EngineConfig(
            model=llama_dir, adapter_slots=2, adapters=(adapters[FIRST],), device="cpu", dtype="float32"
        )
    )
    with (
        gateway(redis_server, prefix) as url,
        worker_thread(redis_server, prefix, FIRST, engine=engine, heartbeat_s=0.2, keep_alive_s=None) as w,
    ):
        _until("first heartbeat", lambda: _live(store, keys, FIRST))
        store.run(workers.send_control(keys, w.worker_id, "bind", function=SECOND))
        joined = _until(
            "the join's bound event",
            lambda: [e for e in _events(store, keys, SECOND) if e["kind"] == control.BOUND],
        )
        assert joined[0]["path"] == control.PATH_JOIN and joined[0]["worker"] == w.worker_id
        assert w.slots == {FIRST: 0, SECOND: 1}
        _until("registered under the joined function", lambda: w.worker_id in _live(store, keys, SECOND))
        info = store.run(workers.worker_info(keys, [w.worker_id]))[w.worker_id]
        _until(
            "heartbeat naming both functions",
            lambda: (
                store.run(workers.worker_info(keys, [w.worker_id]))[w.worker_id].get("functions")
                == f"{FIRST},{SECOND}"
            ),
        )
        info = store.run(workers.worker_info(keys, [w.worker_id]))[w.worker_id]
        assert (info["slots"], info["free_slots"]) == ("2", "0")

        # a bind it cannot take: no free slot, and another namespace (one process, one fault domain)
        store.run(workers.send_control(keys, w.worker_id, "bind", function=THIRD))
        store.run(workers.send_control(keys, w.worker_id, "bind", function=OTHER_NS))
        for function, why in ((THIRD, "all 2 adapter slots are taken"), (OTHER_NS, "namespace 'team-b'")):
            failed = _until(
                f"{function} refused",
                lambda f=function: [e for e in _events(store, keys, f) if e["kind"] == control.BIND_FAILED],
            )
            assert why in failed[0]["reason"], failed[0]
        assert w.worker_id not in _live(store, keys, THIRD)

        answers: dict[tuple[str, int], str] = {}

        def one(function: str, i: int) -> None:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[function], max_retries=0)
            out = client.completions.create(
                model=function, prompt=PROMPTS[i], max_tokens=MAX_NEW, temperature=0
            )
            answers[function, i] = out.choices[0].text

        threads = [
            threading.Thread(target=one, args=(f, i)) for f in (FIRST, SECOND) for i in range(len(PROMPTS))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for function in (FIRST, SECOND):
            assert [answers.get((function, i)) for i in range(len(PROMPTS))] == references[function], function

        # the second function's keep-alive (1 s) ends: it leaves its slot; the first stays
        _until("the joined function left", lambda: SECOND not in w.slots)
        _until("deregistered from it", lambda: w.worker_id not in _live(store, keys, SECOND))
        assert w.worker_id in _live(store, keys, FIRST)
        # its slot is empty again: a function can join into it
        store.run(workers.send_control(keys, w.worker_id, "bind", function=THIRD))
        _until("the third joined", lambda: THIRD in w.slots)
        assert w.slots[THIRD] == 1
