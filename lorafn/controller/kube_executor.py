"""The controller's hands on Kubernetes: desired pod counts in Redis, which the operator turns into pods.

It imports no Kubernetes client (only `lorafn.operator` does); everything goes through `lorafn.store`:

- `gpus()`: the GPU inventory the operator writes (`<p>:gpus`: one entry per GPU the Backbones placed,
  with the backbones whose server pod is Ready there).
- `start(Start)`: a bound worker raises the function's desired replica count (`<fn>:desired_replicas`:
  the operator creates a worker pod `fn-...-<i>`); a standby raises the backbone's desired pool count on
  that GPU for its adapter shape (`<bb>:desired_standby[<gpu>|<shape>]`: the operator creates a standby
  pod there with `--shape`). Each count moves from what the operator runs now (the stored value held
  within the spec's bounds, as the operator holds it), so an increment always means one more pod. With a
  standby's count goes the KV budget the policy granted it (`<bb>:standby_kv[<gpu>|<shape>]`, MiB, written
  first): the planner sizes a standby for the largest registered function of its shape, and a pod started
  with the default KV could never take a function whose spec asks for more (`pick_standby` refuses it),
  so every cold start of such a function would be a fresh pod.
- `stop(worker_id)`: the driver has already sent `stop` (the worker drains and exits, and its pod ends);
  this lowers the count the worker's pod belongs to and marks the pod retiring (`<p>:retiring`), so the
  operator stops counting it at once and deletes no other pod to meet the lower count.
- `starting()`: per count, desired minus the live workers of those pods (heartbeats; retiring ones left
  out), as placeholders the policy counts as starting. A pool pod asked for before this controller
  started (a restart) has size 0 here; the snapshot reader gives it the size this controller would ask
  for (`SnapshotReader.sized_starting`: a standby with the KV budget recorded for its GPU and shape).
- `exits()`: the worker containers that terminated with a non-zero code (or pods that failed without one),
  as the operator reads them from the pods' phases and container statuses and reports them on the lifecycle
  stream (`control.PodExit`; every reconcile reports what it sees, so each termination is counted once
  here): a worker pod of a function that never served counts as a failed start of it (the driver backs
  off further starts and names the reason in the status), as a dead child process does in `lorafn up`.

Which count a worker belongs to: a pool (standby) pod's process heartbeats `standby` before anything
can bind it, so every worker ever seen as standby is remembered as a pool worker (`<p>:pool_workers`,
kept in Redis so that a restarted controller still knows); any other worker serving a function runs in
one of that function's pods.
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from lorafn.api.sizing import MiB
from lorafn.api.specs import BackboneSpec, LoRAFunctionSpec
from lorafn.controller.driver import Exit
from lorafn.controller.policy.actions import Start
from lorafn.controller.policy.model import GPU, Worker
from lorafn.store import Keys, Store, combine, control, workers
from lorafn.store.backbones import get_backbone, list_backbones
from lorafn.store.registry import get_function, list_functions

log = logging.getLogger("lorafn.controller")

# The pods of one count: ("fn", function) or ("pool", backbone, gpu, shape or "*").
CountKey = tuple[str, ...]


def pool_key(backbone: str, gpu: str, shape: str | None) -> CountKey:
    return ("pool", backbone, gpu, shape or control.ANY_SHAPE)


def _shape(key: CountKey) -> str | None:
    return None if key[3] == control.ANY_SHAPE else key[3]


@dataclass(frozen=True)
class LiveWorker:
    """A worker with a fresh heartbeat, as far as the counts care."""

    id: str
    state: str  # standby | serving | starting | draining (the worker's own word)
    function: str | None
    backbone: str
    gpu: str
    shape: str | None = None


@dataclass
class _Asked:
    worker_id: str
    action: Start
    at: float


@dataclass
class _Bounds:
    functions: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # fn -> (backbone, min, max)
    backbones: dict[str, tuple[int, int]] = field(default_factory=dict)  # bb -> (minStandby, maxStandby)


def _placeholder_id(key: CountKey, i: int) -> str:
    """A worker id (the store's `[A-Za-z0-9_.-]`) for a pod asked for before this controller started."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"pending-{'-'.join(key)}-{i}")[:128]


def clamp(value: int | None, low: int, high: int) -> int:
    """What the operator runs for a stored count (None: the controller has not said)."""
    return low if value is None else max(low, min(high, value))


class KubernetesExecutor:
    # the operator reports failed worker containers only (operator.reducers): a cleanly stopped pod's end is
    # never seen here, so the driver counts a stopped worker gone once it deregisters
    reports_every_exit = False

    def __init__(
        self,
        store: Store,
        keys: Keys,
        heartbeat_ttl_s: float,
        clock: object = time.monotonic,
        standby_kv_bytes: Callable[[Start], int] | None = None,
    ) -> None:
        """`standby_kv_bytes`: the KV budget of a standby Start's grant (the controller's
        `SnapshotReader.standby_kv_bytes`, as `lorafn up` passes it to a standby process); None: nothing is
        recorded and the operator starts pool pods with its default."""
        self.store, self.keys, self.heartbeat_ttl_s = store, keys, heartbeat_ttl_s
        self._clock = clock
        self._standby_kv_bytes = standby_kv_bytes
        self._asked: dict[CountKey, list[_Asked]] = defaultdict(list)
        self._placeholders: dict[str, CountKey] = {}  # ids given to pods asked before this controller
        self._gpu_ids: set[str] = set()
        self._resident: dict[str, set[str]] = {}  # GPU id -> backbones loaded there
        self._exits_cursor: str | None = None  # lifecycle events read for pod exits (None: from now on)
        self._exits_seen: set[tuple[str, str]] = set()  # (pod, termination) already returned

    def _now(self) -> float:
        return self._clock()  # type: ignore[operator]

    # -- what the registry says --------------------------------------------------------------------
    def bounds(self) -> _Bounds:
        """Each function's backbone and replica bounds, each backbone's standby bounds (from the specs)."""
        names = self.store.run(list_functions(self.keys))
        bb_names = self.store.run(list_backbones(self.keys))
        records = self.store.run(combine(*(get_function(self.keys, n) for n in names))) if names else ()
        bb_records = (
            self.store.run(combine(*(get_backbone(self.keys, n) for n in bb_names))) if bb_names else ()
        )
        out = _Bounds()
        for record in records:
            if record is None:
                continue
            spec = LoRAFunctionSpec.model_validate(record.spec)
            out.functions[record.function] = (
                spec.backbone,
                spec.scaling.min_replicas,
                spec.scaling.max_replicas,
            )
        for record in bb_records:
            if record is None:
                continue
            pool = BackboneSpec.model_validate(record.spec).warm_pool if record.spec else None
            out.backbones[record.name] = (pool.min_standby, pool.max_standby) if pool else (0, 0)
        return out

    def live_workers(self) -> tuple[list[LiveWorker], set[str]]:
        """Workers with a fresh heartbeat, and the ids of every worker still registered (fresh or not)."""
        ids = self.store.run(workers.worker_ids(self.keys))
        info = self.store.run(workers.worker_info(self.keys, ids)) if ids else {}
        now_ms = self.store.run(workers.server_time_ms())
        ttl_ms = self.heartbeat_ttl_s * 1000
        out = []
        for wid, h in sorted(info.items()):
            if now_ms - int(h.get("heartbeat") or now_ms) > ttl_ms:
                continue
            out.append(
                LiveWorker(
                    id=wid,
                    state=h.get("state", "serving"),
                    function=h.get("function") or None,
                    backbone=h.get("backbone", ""),
                    gpu=h.get("gpu", ""),
                    shape=h.get("shape") or None,
                )
            )
        return out, set(ids)

    # -- Executor ----------------------------------------------------------------------------------
    def gpus(self) -> list[GPU]:
        inventory = self.store.run(control.gpus(self.keys))
        out = []
        for gid, entry in sorted(inventory.items()):
            try:
                out.append(
                    GPU(
                        id=gid,
                        node=str(entry.get("node", "")),
                        total_bytes=int(entry.get("total_bytes", 0)),
                        backbones={str(k): int(v) for k, v in (entry.get("backbones") or {}).items()},
                    )
                )
            except (TypeError, ValueError) as e:  # a bad entry costs that GPU, not the round
                log.error("controller: GPU inventory entry %s is unusable: %s", gid, e)
        self._gpu_ids = {g.id for g in out}
        self._resident = {g.id: set(g.backbones) for g in out}
        return out

    def start(self, action: Start, worker_id: str) -> None:
        bounds = self.bounds()
        if action.function:
            if action.function not in bounds.functions:
                log.warning("controller: start for %s, which is not registered", action.function)
                return
            _, low, high = bounds.functions[action.function]
            n = self.store.run(control.add_desired_replicas(self.keys, action.function, 1, low, high))
            key: CountKey = ("fn", action.function)
            log.info("controller: %s desired replicas -> %d", action.function, n)
        else:
            low, high = bounds.backbones.get(action.backbone, (0, 0))
            kv_mib = self.standby_kv_mib(action)
            # the budget first: an operator that sees the new count (it reads counts, then budgets) starts
            # the new pod with this budget
            record = (
                [control.set_standby_kv(self.keys, action.backbone, action.gpu, action.shape, kv_mib)]
                if kv_mib is not None
                else []
            )
            add = control.add_desired_standby(
                self.keys, action.backbone, action.gpu, action.shape, 1, low, high
            )
            n = self.store.run(combine(*record, add))[-1]
            key = pool_key(action.backbone, action.gpu, action.shape)
            log.info(
                "controller: %s pool pods on %s of shape %s -> %d (KV budget %s MiB)",
                action.backbone, action.gpu, action.shape or "any", n, kv_mib or "default",
            )  # fmt: skip
        self._asked[key].append(_Asked(worker_id, action, self._now()))

    def standby_kv_mib(self, action: Start) -> int | None:
        """The KV budget of a standby Start in MiB; None without a sizer. The sizer owns the rounding
        (`SnapshotReader.standby_kv_bytes` rounds up to whole MiB, so the standby holds what it was sized
        for); a budget that is not whole MiB is refused rather than rounded a second time here."""
        if self._standby_kv_bytes is None:
            return None
        kv = int(self._standby_kv_bytes(action))
        if kv <= 0 or kv % MiB:
            raise ValueError(f"standby_kv_bytes: a whole number of MiB > 0 is needed, got {kv} bytes")
        return kv // MiB

    def stop(self, worker_id: str) -> None:
        """Lower the count of the worker's pod and mark the pod retiring (the worker got `stop` already)."""
        bounds = self.bounds()
        key = self._key_of(worker_id)
        if key is None:
            log.info("controller: stop %s: no pod of a count is known for it", worker_id)
            return
        if key[0] == "fn":
            asked = [a for a in self._asked.get(key, []) if a.worker_id == worker_id]
            if key[1] in bounds.functions:
                _, low, high = bounds.functions[key[1]]
                self.store.run(control.add_desired_replicas(self.keys, key[1], -1, low, high))
        else:
            asked = [a for a in self._asked.get(key, []) if a.worker_id == worker_id]
            low, high = bounds.backbones.get(key[1], (0, 0))
            self.store.run(control.add_desired_standby(self.keys, key[1], key[2], _shape(key), -1, low, high))
        if asked or worker_id in self._placeholders:  # nothing runs under that id yet: the count says it
            self._asked[key] = [a for a in self._asked.get(key, []) if a.worker_id != worker_id]
            self._placeholders.pop(worker_id, None)
        else:
            now_ms = self.store.run(workers.server_time_ms())
            self.store.run(control.retire(self.keys, worker_id, now_ms))

    def _key_of(self, worker_id: str) -> CountKey | None:
        for key, asked in self._asked.items():
            if any(a.worker_id == worker_id for a in asked):
                return key
        if worker_id in self._placeholders:
            return self._placeholders[worker_id]
        pool = self.store.run(control.pool_workers(self.keys))
        if worker_id in pool:
            return pool_key(*pool[worker_id])
        info = self.store.run(workers.worker_info(self.keys, [worker_id])).get(worker_id)
        if info and info.get("state") == "standby":
            return pool_key(info.get("backbone", ""), info.get("gpu", ""), info.get("shape") or None)
        if info and info.get("function"):
            return ("fn", info["function"])
        return None

    def starting(self) -> list[Worker]:
        """Placeholders for the pods asked for and not yet heartbeating (desired minus live, per count)."""
        bounds = self.bounds()
        live, registered = self.live_workers()
        retiring = set(self.store.run(control.retiring(self.keys)))
        pool = self._learn_pool(live, registered)
        have: dict[CountKey, int] = defaultdict(int)
        for w in live:
            if w.id in retiring or w.state == "draining":
                continue
            if w.id in pool:
                have[pool_key(*pool[w.id])] += 1
            elif w.function:
                have[("fn", w.function)] += 1
        fns = sorted(bounds.functions)
        stored = self.store.run(control.desired_replicas(self.keys, fns)) if fns else {}
        want: dict[CountKey, tuple[str, int]] = {}  # key -> (backbone, pods the operator runs)
        for fn in fns:
            backbone, low, high = bounds.functions[fn]
            want[("fn", fn)] = (backbone, clamp(stored.get(fn), low, high))
        for backbone, (low, high) in sorted(bounds.backbones.items()):
            stored = self.store.run(control.desired_standby(self.keys, backbone))
            for gpu in sorted(self._gpu_ids | {g for g, _ in stored}):
                for shape, n in control.standby_counts(stored, gpu, low, high).items():
                    want[pool_key(backbone, gpu, shape)] = (backbone, n)
        self._placeholders = {}
        out: list[Worker] = []
        now = self._now()
        for key, (backbone, n) in want.items():
            missing = max(0, n - have.get(key, 0))
            asked = self._asked.get(key, [])
            # The newest asks are the ones not yet answered; older ones have become live pods.
            self._asked[key] = asked = asked[len(asked) - missing :] if missing else []
            for i in range(missing):
                a = asked[i] if i < len(asked) else None
                gpu = a.action.gpu if a else (key[2] if key[0] == "pool" else "")
                if backbone not in self._resident.get(gpu, ()):
                    # Not on a GPU the account knows, or its backbone is not loaded there yet: such a pod
                    # cannot start (it waits for the backbone server), so the policy does not see it (it
                    # would stop it as misplaced, and the operator would delete a pod about to be useful).
                    continue
                wid = a.worker_id if a else _placeholder_id(key, i)
                if a is None:
                    self._placeholders[wid] = key
                out.append(
                    Worker(
                        id=wid,
                        gpu=gpu,
                        backbone=backbone,
                        state="starting",
                        shape=a.action.shape if a else (_shape(key) if key[0] == "pool" else None),
                        function=key[1] if key[0] == "fn" else None,
                        mem_bytes=a.action.mem_bytes if a else 0,
                        age_s=now - a.at if a else 0.0,
                    )
                )
        for key in [k for k in self._asked if k not in want]:
            del self._asked[key]
        return out

    def _learn_pool(
        self, live: list[LiveWorker], registered: set[str]
    ) -> dict[str, tuple[str, str, str | None]]:
        """Remember workers seen as standby (pool pods); forget those that left the worker registry (a
        late heartbeat alone does not make a bound pool worker count as a pod of its function)."""
        pool = self.store.run(control.pool_workers(self.keys))
        new = {
            w.id: (w.backbone, w.gpu, w.shape)
            for w in live
            if w.state == "standby" and pool.get(w.id) != (w.backbone, w.gpu, w.shape)
        }
        gone = [wid for wid in pool if wid not in registered]
        self.store.run(
            combine(
                control.remember_pool_workers(self.keys, new), control.forget_pool_workers(self.keys, gone)
            )
        )
        pool.update(new)
        for wid in gone:
            pool.pop(wid, None)
        return pool

    def exits(self) -> list[Exit]:
        """Worker pods whose container terminated since the last call (see the module docstring)."""
        if self._exits_cursor is None:  # a restarted controller does not count old exits again
            self._exits_cursor = self.store.run(control.last_event_id(self.keys))
            return []
        out = []
        for entry_id, event in self.store.run(control.read_events(self.keys, self._exits_cursor)):
            self._exits_cursor = entry_id
            if event.get("kind") != control.POD_EXITED:
                continue
            pod = control.PodExit.from_event(event)
            if not pod.worker_id or (pod.worker_id, pod.marker) in self._exits_seen:
                continue
            if len(self._exits_seen) > 100_000:  # bounded: an operator restart re-reports at most its pods
                self._exits_seen.clear()
            self._exits_seen.add((pod.worker_id, pod.marker))
            out.append(Exit(pod.worker_id, pod.function or None, pod.code, pod.reason))
        return out
