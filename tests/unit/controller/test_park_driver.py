"""The driver applies parking (`PolicyConfig.park_idle`, docs/PARKING protocol) around a real redis-server: a
plan's Park is sent first and waited for (the worker's `parked` / `park_refused` lifecycle event), the Start
it made room for follows only once the worker said it parked; a refused or unanswered park drops the action it
made room for this round (`actions.unbacked`), not the GPU's others; events read while waiting are handled as
usual; demand for a function whose workers are all parked is answered at once by an unpark (`fast_unparks`);
the snapshot reads `parked` and `park_release_bytes` from the heartbeats and charges a parked worker what it
still holds.

The worker's side is a thread that reads the worker's real control stream and answers on the lifecycle stream
with the fields the protocol names, as the worker process does."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from lorafn.controller.driver import Controller, ControllerConfig
from lorafn.controller.policy.actions import Park, Start, Stop, Unpark
from lorafn.controller.policy.charge import OVERHEAD_MARGIN_BYTES
from lorafn.controller.policy.config import PolicyConfig
from lorafn.controller.policy.model import GPU
from lorafn.controller.snapshot import SizingConfig
from lorafn.store import GROUP, Keys, Store, control, streams, workers
from tests.unit.controller.redis_world import RecordingExecutor, commands, queue_request, register_tiny

NEW, NEW2, IDLE, BUSY = "team/new", "team/new2", "team/idle", "team/busy"
MiB = 1 << 20
KV = 64 * MiB  # the default KV budget: most of a worker, what a park releases


@pytest.fixture
def world(redis_server: str, tmp_path: Path) -> Iterator[tuple[Store, Keys, Controller, RecordingExecutor]]:
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    long = {"scaling": {"keepAliveSeconds": 3600}}  # parked, not retired by its keep-alive
    register_tiny(store, keys, tmp_path, {NEW: long, NEW2: long, IDLE: long, BUSY: long}, warm_pool=(0, 0))
    executor = RecordingExecutor([GPU("g0", "n", 1 << 40, {"tiny": 0})])
    controller = Controller(
        store, keys, executor, SizingConfig(worker_overhead_bytes=MiB, default_kv_bytes=KV),
        ControllerConfig(
            holder="me", park_timeout_s=5.0,
            policy=PolicyConfig(park_idle=True, cold_prior_rps=0.0, pool_min_age_s=3600),
        ),
    )  # fmt: skip
    yield store, keys, controller, executor
    store.close()


def _beat(
    store: Store, keys: Keys, wid: str, function: str, running: int = 0, parked: bool = False, **extra: object
) -> None:
    """A bound worker's heartbeat as the runtime writes it (CPU: no driver count), parking fields included."""
    fields = {
        "state": "serving", "gpu": "g0", "backbone": "tiny", "shape": "", "mem_bytes": 0,
        "started": int(time.time()) - 600, "idle_s": 0 if running else 600, "running": running,
        "parked": int(parked), "kv_bytes": 0 if parked else KV, "park_release_bytes": KV, **extra,
    }  # fmt: skip
    store.run(workers.heartbeat(keys, wid, function, 5000, fields))


class _Worker(threading.Thread):
    """A worker's control loop, reduced to parking: it reads its control stream (as the runtime's idle loop
    does) and answers each `park` with ``answer(n)`` (n: 1 for its first park, ...): the event kind and
    fields, or None to stay silent; `unpark` with `unparked`. ``before``: events it posts before its first
    answer (another worker's news that the driver must not lose)."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        wid: str,
        function: str,
        answer: Callable[[int], tuple[str, dict[str, object]] | None],
        before: list[tuple[str, dict[str, object]]] | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.store, self.keys, self.wid, self.function, self.answer = store, keys, wid, function, answer
        self.before = before or []
        self.done = threading.Event()
        self.seen: list[str] = []
        self.ready = threading.Event()

    def run(self) -> None:
        last, parks = self.store.run(workers.last_control_id(self.keys, self.wid)), 0
        self.ready.set()
        while not self.done.is_set():
            for entry_id, body in self.store.run(
                workers.read_control(self.keys, self.wid, last, block_ms=50)
            ):
                last = entry_id
                self.seen.append(body["cmd"])
                where = {"worker": self.wid, "function": self.function, "gpu": "g0"}
                if body["cmd"] == "park":
                    parks += 1
                    for kind, fields in self.before:
                        self.store.run(control.post_event(self.keys, kind, **fields))
                    self.before = []
                    reply = self.answer(parks)
                    if reply is not None:
                        self.store.run(control.post_event(self.keys, reply[0], **where, **reply[1]))
                elif body["cmd"] == "unpark":
                    self.store.run(control.post_event(self.keys, control.UNPARKED, **where, kv_bytes=KV))

    def start(self) -> None:
        super().start()
        self.ready.wait(5)  # commands from now on are its (a worker reads after what was there)

    def stop(self) -> None:
        self.done.set()
        self.join(5)


def _full_gpu(store: Store, keys: Keys, controller: Controller, executor: RecordingExecutor) -> int:
    """g0 holds two workers, not three: ``w-idle`` (IDLE, idle 600 s) and ``w-busy`` (BUSY, running);
    NEW has a request queued. The size of one worker."""
    controller.round()
    size = controller.reader.sizes[NEW].mem_bytes
    executor._gpus = [GPU("g0", "n", int((2 * size + size // 2) / 0.92), {"tiny": 0})]
    _beat(store, keys, "w-idle", IDLE)
    _beat(store, keys, "w-busy", BUSY, running=1)
    queue_request(store, keys, NEW, "r1")
    return size


def _sample(controller: Controller, name: str, labels: dict[str, str] | None = None) -> float:
    return controller.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def _new_starts(executor: RecordingExecutor) -> list[Start]:
    return [s for s in executor.started if s.function == NEW]


def test_a_start_waits_for_the_park_that_makes_its_room(world) -> None:
    store, keys, controller, executor = world
    _full_gpu(store, keys, controller, executor)
    seen_start: list[int] = []

    def answer(n: int) -> tuple[str, dict[str, object]]:
        seen_start.append(len(_new_starts(executor)))  # what had started when the worker got the park
        return control.PARKED, {"released_bytes": KV}

    worker = _Worker(store, keys, "w-idle", IDLE, answer)
    worker.start()
    try:
        plan = controller.round()
    finally:
        worker.stop()
    assert [(p.worker_id, p.room_for) for p in plan.of_type(Park)] == [("w-idle", NEW)]
    assert seen_start == [0]  # the park went out before the start ...
    assert len(_new_starts(executor)) == 1  # ... which followed its answer in the same round
    assert not plan.of_type(Unpark)
    assert commands(store, keys, "w-idle") == [{"cmd": "park"}]
    assert commands(store, keys, "w-busy") == []
    assert _sample(controller, "lorafn_controller_parks_total", {"path": "round"}) == 1
    assert _sample(controller, "lorafn_controller_park_wait_seconds_count") == 1

    # the next round: the heartbeat still says unparked (it beats once a second) and NEW's worker is still
    # starting: the acknowledged park counts, so nothing is parked again or stopped for the start
    executor.starting = lambda: [  # type: ignore[method-assign]
        _starting(controller, s, "w-new") for s in _new_starts(executor)
    ]
    plan = controller.round()
    assert plan.of_type(Park) == [] and plan.of_type(Stop) == []
    assert len(_new_starts(executor)) == 1
    assert commands(store, keys, "w-idle") == [{"cmd": "park"}]
    parked = next(w for w in controller.last_snapshot.workers if w.id == "w-idle")
    assert parked.parked and parked.release_bytes == KV

    _beat(store, keys, "w-idle", IDLE, parked=True)  # the heartbeat says so now: the pending park is done
    controller.round()
    assert controller._parks == {}
    assert commands(store, keys, "w-idle") == [{"cmd": "park"}]


def _starting(controller: Controller, start: Start, wid: str):  # type: ignore[no-untyped-def]
    from lorafn.controller.policy.model import Worker

    return Worker(wid, start.gpu, start.backbone, "starting", start.shape, start.function, start.mem_bytes)


def test_a_refused_park_drops_its_gpus_actions_and_the_next_round_plans_again(world) -> None:
    store, keys, controller, executor = world
    _full_gpu(store, keys, controller, executor)

    def answer(n: int) -> tuple[str, dict[str, object]]:
        if n == 1:  # a request reached it between its heartbeat and the command
            return control.PARK_REFUSED, {"reason": "busy: 1 running"}
        return control.PARKED, {"released_bytes": KV}

    worker = _Worker(store, keys, "w-idle", IDLE, answer)
    worker.start()
    try:
        plan = controller.round()
        assert plan.of_type(Park) and plan.of_type(Start)  # planned ...
        assert _new_starts(executor) == []  # ... but the start on g0 was dropped with the refused park
        assert _sample(controller, "lorafn_controller_park_refusals_total", {"reason": "refused"}) == 1
        assert _sample(controller, "lorafn_controller_parks_total", {"path": "round"}) == 0
        assert controller._parks == {}
        plan = controller.round()  # fresh heartbeats, the same picture: park again, this time it parks
        assert len(_new_starts(executor)) == 1
    finally:
        worker.stop()
    assert worker.seen == ["park", "park"]
    assert _sample(controller, "lorafn_controller_parks_total", {"path": "round"}) == 1


def test_a_refused_park_drops_only_the_start_it_made_room_for(world) -> None:
    # two idle workers on a GPU with room for half a worker more, two functions waiting: the plan parks one
    # for each; w-idle refuses (a request reached it), w-busy (idle here) parks: the start its park made room
    # for goes this round, the other waits for the next
    store, keys, controller, executor = world
    controller.round()
    size = controller.reader.sizes[NEW].mem_bytes
    executor._gpus = [GPU("g0", "n", int((2 * size + size // 2) / 0.92), {"tiny": 0})]
    _beat(store, keys, "w-idle", IDLE)
    _beat(store, keys, "w-busy", BUSY)
    queue_request(store, keys, NEW, "r1")
    queue_request(store, keys, NEW2, "r2")
    busy = {"reason": "busy: 1 running"}
    refuser = _Worker(store, keys, "w-idle", IDLE, lambda n: (control.PARK_REFUSED, busy))
    parker = _Worker(store, keys, "w-busy", BUSY, lambda n: (control.PARKED, {"released_bytes": KV}))
    refuser.start()
    parker.start()
    try:
        plan = controller.round()
    finally:
        refuser.stop()
        parker.stop()
    room = {p.worker_id: p.room_for for p in plan.of_type(Park)}
    assert set(room) == {"w-idle", "w-busy"} and set(room.values()) == {NEW, NEW2}
    assert {s.function for s in plan.of_type(Start)} == {NEW, NEW2}  # planned both ...
    assert [s.function for s in executor.started] == [room["w-busy"]]  # ... started the backed one
    assert _sample(controller, "lorafn_controller_park_refusals_total", {"reason": "refused"}) == 1
    assert _sample(controller, "lorafn_controller_parks_total", {"path": "round"}) == 1


def test_a_worker_that_took_a_request_since_its_heartbeat_is_not_parked(world) -> None:
    # w-idle's heartbeat says idle, but its function has a request delivered and not acknowledged (the
    # worker read it after beating): the snapshot counts it running, and the round plans no park of it
    store, keys, controller, executor = world
    _full_gpu(store, keys, controller, executor)
    queue_request(store, keys, IDLE, "r-idle")
    client = redis.Redis.from_url(store.url)
    try:
        client.xgroup_create(keys.requests(IDLE), GROUP, id="0", mkstream=True)  # as a worker does
        assert client.xreadgroup(GROUP, "w-idle", {keys.requests(IDLE): ">"}, count=1)
    finally:
        client.close()
    plan = controller.round()
    seen = next(w for w in controller.last_snapshot.workers if w.id == "w-idle")
    assert seen.running == 1 and seen.idle_s == 0.0
    assert plan.of_type(Park) == []
    assert commands(store, keys, "w-idle") == []
    # acknowledged (and deleted, as a worker does): the heartbeat is right again and the round parks it for
    # NEW (nobody answers here: the park times out; it was planned and sent)
    client = redis.Redis.from_url(store.url)
    try:
        for entry_id, _ in client.xrange(keys.requests(IDLE)):
            client.xack(keys.requests(IDLE), GROUP, entry_id)
            client.xdel(keys.requests(IDLE), entry_id)
    finally:
        client.close()
    controller.config.park_timeout_s = 0.2
    plan = controller.round()
    assert [p.worker_id for p in plan.of_type(Park)] == ["w-idle"]
    assert commands(store, keys, "w-idle") == [{"cmd": "park"}]


def test_an_unanswered_park_times_out_and_events_read_meanwhile_are_not_lost(world, caplog) -> None:
    store, keys, controller, executor = world
    caplog.set_level(logging.INFO, "lorafn.controller")
    controller.config.park_timeout_s = 0.5
    _full_gpu(store, keys, controller, executor)
    # while the driver waits, another worker of BUSY reports it bound: the driver must still record it
    other = (control.BOUND, {"worker": "w-other", "function": BUSY, "ms": 42, "path": "standby"})
    worker = _Worker(store, keys, "w-idle", IDLE, lambda n: None, before=[other])
    worker.start()
    try:
        controller.round()
    finally:
        worker.stop()
    assert worker.seen == ["park"]
    assert _new_starts(executor) == []
    assert _sample(controller, "lorafn_controller_park_refusals_total", {"reason": "timeout"}) == 1
    status = store.run(control.statuses(keys, [BUSY]))[BUSY]
    assert status.get("last_cold_start_ms") == "42" and status.get("last_cold_path") == "standby"
    assert _sample(controller, "lorafn_controller_cold_starts_total", {"path": "standby"}) == 1

    # a late answer to that park is read by the next round's learning, and not taken for a new park's
    store.run(
        control.post_event(keys, control.PARKED, worker="w-idle", function=IDLE, gpu="g0", released_bytes=KV)
    )
    worker = _Worker(store, keys, "w-idle", IDLE, lambda n: None)
    worker.start()
    try:
        controller.round()  # the heartbeat still says unparked: the plan parks again, nobody answers
    finally:
        worker.stop()
    assert worker.seen == ["park"]
    assert _new_starts(executor) == []
    assert _sample(controller, "lorafn_controller_park_refusals_total", {"reason": "timeout"}) == 2
    assert "late answer to a park: w-idle parked" in caplog.text


def test_a_worker_that_cannot_park_is_stopped_instead_for_a_while(world) -> None:
    # a refusal that is no passing state (graph archives, an engine that cannot park): the next rounds plan no
    # park of it (ControllerConfig.park_retry_s) and offload it as without parking, instead of parking it
    # again and dropping the start every round
    store, keys, controller, executor = world
    _full_gpu(store, keys, controller, executor)
    worker = _Worker(
        store, keys, "w-idle", IDLE, lambda n: (control.PARK_REFUSED, {"reason": "graph archives"})
    )
    worker.start()
    try:
        controller.round()
        assert _new_starts(executor) == []
        plan = controller.round()
    finally:
        worker.stop()
    assert worker.seen == ["park", "stop"]
    assert plan.of_type(Park) == [] and [s.worker_id for s in plan.of_type(Stop)] == ["w-idle"]
    assert not next(w for w in controller.last_snapshot.workers if w.id == "w-idle").parkable
    # a runtime that does not report park_release_bytes cannot park: never planned one
    _beat(store, keys, "w-old", BUSY, park_release_bytes="")
    controller.round()
    assert not next(w for w in controller.last_snapshot.workers if w.id == "w-old").parkable


def test_demand_for_a_parked_function_unparks_it_at_once(world) -> None:
    store, keys, controller, executor = world
    controller.round()
    _beat(store, keys, "w-idle", IDLE, parked=True)
    controller.round()  # the snapshot the fast path answers from: w-idle parked, nothing queued
    assert [w.parked for w in controller.last_snapshot.workers if w.id == "w-idle"] == [True]
    assert controller.wait_for_demand(0.01) == []

    # a request while parked: the worker reads no requests; it records demand for its function
    queue_request(store, keys, IDLE, "r1")  # (queue_request records the gateway's demand too; the
    store.run(streams.record_demand(keys, IDLE, "parked", guard_ms=1))  # parked worker's, as it would)
    answered = controller.answer_demand(controller.wait_for_demand(5.0))
    assert [(type(a), a.worker_id, a.function) for a in answered] == [(Unpark, "w-idle", IDLE)]
    assert commands(store, keys, "w-idle") == [{"cmd": "unpark"}]
    assert _sample(controller, "lorafn_controller_unparks_total", {"path": "fast"}) == 1
    assert not executor.started  # no fresh start, no bind: its own worker takes the request

    # the round after it, before the heartbeat shows it: no second unpark, no start for IDLE
    plan = controller.round()
    assert not plan.of_type(Unpark) and not [s for s in plan.of_type(Start) if s.function == IDLE]
    assert commands(store, keys, "w-idle") == [{"cmd": "unpark"}]
    unparked = next(w for w in controller.last_snapshot.workers if w.id == "w-idle")
    assert not unparked.parked
    _beat(store, keys, "w-idle", IDLE, running=1)  # serving again
    controller.round()
    assert controller._unparks == {}


def test_the_fast_unpark_parks_an_idle_worker_first_where_its_kv_does_not_fit(world) -> None:
    store, keys, controller, executor = world
    controller.round()
    size = controller.reader.sizes[NEW].mem_bytes
    # g0 holds two unparked workers and a parked one, not three unparked
    executor._gpus = [GPU("g0", "n", int((2 * size + size // 2) / 0.92), {"tiny": 0})]
    _beat(store, keys, "w-parked", NEW, parked=True)
    _beat(store, keys, "w-idle", IDLE)
    _beat(store, keys, "w-busy", BUSY, running=1)
    controller.round()
    assert {w.id: w.parked for w in controller.last_snapshot.workers} == {
        "w-parked": True, "w-idle": False, "w-busy": False
    }  # fmt: skip
    controller.wait_for_demand(0.01)
    worker = _Worker(store, keys, "w-idle", IDLE, lambda n: (control.PARKED, {"released_bytes": KV}))
    worker.start()
    try:
        store.run(streams.record_demand(keys, NEW, "parked", guard_ms=1))
        answered = controller.answer_demand(controller.wait_for_demand(5.0))
    finally:
        worker.stop()
    assert [(type(a), a.worker_id) for a in answered] == [(Unpark, "w-parked")]
    assert worker.seen == ["park"]  # parked before the unpark was sent
    assert commands(store, keys, "w-parked") == [{"cmd": "unpark"}]
    assert _sample(controller, "lorafn_controller_parks_total", {"path": "fast"}) == 1


def test_the_snapshot_reads_parking_from_heartbeats_and_charges_a_parked_worker_what_it_holds(world) -> None:
    store, keys, controller, _ = world
    controller.round()
    estimate = controller.reader.sizes[IDLE].mem_bytes
    lora = controller.reader.sizes[IDLE].lora_bytes
    _beat(store, keys, "w-parked", IDLE, parked=True)
    _beat(store, keys, "w-idle", NEW)
    _beat(store, keys, "w-old", BUSY, park_release_bytes="")  # a runtime that does not say
    # a GPU worker (the driver's count of its process): parked, it is charged that count + the margin
    whole = 300 * MiB
    _beat(store, keys, "w-gpu", BUSY, parked=True, mem_bytes=whole, mem_source="driver", lora_bytes=lora,
          graphs_pending=0)  # fmt: skip
    controller.round()
    by_id = {w.id: w for w in controller.last_snapshot.workers}
    # CPU: no driver count; parked, the estimate less what the park released, and unparking takes it back
    assert by_id["w-parked"].parked and by_id["w-parked"].mem_bytes == estimate - KV
    assert by_id["w-parked"].release_bytes == KV
    assert not by_id["w-idle"].parked and by_id["w-idle"].mem_bytes == estimate
    assert by_id["w-idle"].release_bytes == KV
    assert by_id["w-old"].release_bytes == 0 and by_id["w-old"].mem_bytes == estimate
    gpu = by_id["w-gpu"]
    assert gpu.parked and gpu.mem_bytes == whole + OVERHEAD_MARGIN_BYTES
    # unparked again it is charged as a worker whose graphs are pending: at least the estimate
    assert gpu.release_bytes == max(whole + KV, estimate) - gpu.mem_bytes
    # a busy worker's heartbeat claiming parked is not believed (the policy's model refuses it)
    _beat(store, keys, "w-parked", IDLE, running=1, parked=True)
    controller.round()
    assert not next(w for w in controller.last_snapshot.workers if w.id == "w-parked").parked


def test_park_idle_and_its_timeout_are_controller_settings() -> None:
    from lorafn.controller.cli import ControllerSettings, build_controller
    from lorafn.local.config import LocalConfig

    assert ControllerSettings().park_idle is True and LocalConfig().park_idle is True  # on by default
    settings = ControllerSettings(park_idle=True, park_timeout_s=0.5, redis_url="redis://127.0.0.1:1")
    controller = build_controller(settings)
    assert controller.config.policy.park_idle is True and controller.config.park_timeout_s == 0.5
    with pytest.raises(ValueError, match="park_timeout_s"):
        ControllerConfig(park_timeout_s=0.0)
