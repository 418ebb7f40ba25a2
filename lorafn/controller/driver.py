"""The controller's driver: each round, read Redis into a `Snapshot`, let the pure policy `decide`, and
carry the plan out. One driver for both modes; what differs is the `Executor` that starts and stops
worker processes (`lorafn up`: child processes; Kubernetes: desired pod counts for the operator).

A round, in order:
1. Hold the lease (one active controller per deployment); a standby controller only renews its claim.
2. Learn what happened since the last round: processes that ended (the executor), and the workers'
   lifecycle events (a standby bound in N ms; a bind failed). A worker that died before serving counts
   as a failed start of its function (exponential backoff in the policy, the reason in its status).
3. Snapshot (Redis + the executor's starting workers + binds sent but not yet confirmed), `decide`.
4. Apply: Stop (a `stop` control command: the worker drains and exits), Start (the executor),
   Bind (a `bind` control command to the standby), Wait (the reason into the function's status, where
   the gateway and `lorafn status` read it); write the pool targets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Protocol

from lorafn.controller.metrics import ControllerMetrics
from lorafn.controller.policy.actions import Bind, Plan, Start, Stop, Wait
from lorafn.controller.policy.config import PolicyConfig
from lorafn.controller.policy.decide import decide
from lorafn.controller.policy.model import GPU, Worker
from lorafn.controller.snapshot import SizingConfig, SnapshotReader
from lorafn.store import UNAVAILABLE_ERRORS, Keys, Store, combine, control, streams, workers

log = logging.getLogger("lorafn.controller")


@dataclass(frozen=True)
class Exit:
    """A worker process/pod that ended: `served` when it ever heartbeated as serving a function."""

    worker_id: str
    function: str | None
    code: int | None
    reason: str
    served: bool = False


class Executor(Protocol):
    """Starts and stops worker processes; knows the devices and the workers still coming up."""

    def gpus(self) -> list[GPU]: ...

    def start(self, action: Start, worker_id: str) -> None: ...

    def stop(self, worker_id: str) -> None: ...

    def starting(self) -> list[Worker]: ...

    def exits(self) -> list[Exit]: ...


@dataclass
class ControllerConfig:
    interval_s: float = 0.5
    lease_ttl_s: float = 10.0
    bind_timeout_s: float = 60.0  # a bind not confirmed by then is forgotten (the worker died, or lost it)
    heartbeat_ttl_s: float = 5.0
    holder: str = field(default_factory=lambda: f"{socket.gethostname()[:40]}-{os.getpid()}")
    policy: PolicyConfig = field(default_factory=PolicyConfig)


@dataclass
class _PendingBind:
    function: str
    sent_at: float


class Controller:
    def __init__(
        self, store: Store, keys: Keys, executor: Executor, sizing: SizingConfig, config: ControllerConfig
    ) -> None:
        self.store, self.keys, self.executor, self.config = store, keys, executor, config
        self.reader = SnapshotReader(store, keys, sizing, config.heartbeat_ttl_s)
        self._binds: dict[str, _PendingBind] = {}
        self._events_cursor: str | None = None
        self._counter = 0
        self._waiting: set[str] = set()
        self._problems: set[str] | None = None  # functions whose status holds a `problem` (None: unknown)
        # workers that reached serving (a `bound` event): a later crash is not a failed start
        self._served: set[str] = set()
        # worker id -> when its stop was sent: one stop command per worker, not one per round
        self._stops_sent: dict[str, float] = {}
        self._demand_cursor: str | None = None
        self._exits: list[
            Exit
        ] = []  # ended workers not yet learned from  # demand entries after this one wake the loop
        self.last_plan: Plan | None = None
        self.metrics = ControllerMetrics()

    # -- one round -------------------------------------------------------------------------------
    def round(self) -> Plan | None:
        """One decision round; None when another controller holds the lease."""
        ttl_ms = int(self.config.lease_ttl_s * 1000)
        if not self.store.run(control.acquire_lease(self.keys, self.config.holder, ttl_ms)):
            return None
        t0 = time.perf_counter()
        self._learn()
        snapshot = self.reader.read(self.executor.gpus(), self.executor.starting())
        snapshot = self._with_pending_binds(snapshot)
        plan = decide(snapshot, self.config.policy)
        self._apply(plan)
        self.last_plan = plan
        m = self.metrics
        m.pool_target.set(sum(t.count for t in plan.pool))
        m.pool_standby.set(sum(1 for w in snapshot.workers if w.state == "standby"))
        m.waiting.set(len(self._waiting))
        m.rounds.observe(time.perf_counter() - t0)
        return plan

    def serve_forever(self, stop_after_s: float | None = None) -> None:
        deadline = None if stop_after_s is None else time.monotonic() + stop_after_s
        while deadline is None or time.monotonic() < deadline:
            try:
                self.round()
            except UNAVAILABLE_ERRORS as e:
                log.warning("controller: Redis unreachable (%s); retrying", e)
            except Exception:  # one bad round (a bad record, a bug) must not stop every later decision
                log.exception("controller: round failed; trying again next interval")
            self.wait_for_demand(self.config.interval_s)

    def wait_for_demand(self, timeout_s: float) -> bool:
        """Sleep up to `timeout_s`, waking as soon as the gateway records cold-start demand (a request
        that found no live worker): the round that answers it starts at once, not an interval later.
        True when demand woke it."""
        try:
            if self._demand_cursor is None:  # from now on (a stream id from Redis's clock, not "$",
                # so that demand recorded while a round runs still wakes the next wait)
                self._demand_cursor = f"{self.store.run(workers.server_time_ms())}-0"
            entries = self.store.run(
                streams.read_demand(self.keys, self._demand_cursor, max(1, int(timeout_s * 1000)))
            )
        except UNAVAILABLE_ERRORS:
            time.sleep(timeout_s)
            return False
        for entry_id, _fields in entries:
            self._demand_cursor = entry_id
        return bool(entries)

    # -- what happened ---------------------------------------------------------------------------
    def _learn(self) -> None:
        # exits are taken from the executor once: keep them until learned, so that a Redis error half way
        # (writing a failed start's status) leaves the rest for the next round instead of losing them
        self._exits.extend(self.executor.exits())
        while self._exits:
            ended = self._exits[0]
            self._learn_exit(ended)
            self._exits.pop(0)
        if self._events_cursor is None:  # events from before this controller started are history
            self._events_cursor = self.store.run(control.last_event_id(self.keys))
            return
        self._learn_events()

    def _learn_exit(self, ended: Exit) -> None:
        """One ended worker; safe to repeat after a Redis error (state is dropped only at the end)."""
        served = ended.served or ended.worker_id in self._served
        if ended.function and not served and ended.code not in (0, None):
            self._failed(
                ended.function, f"worker {ended.worker_id} exited with code {ended.code}: {ended.reason}"
            )
        self._binds.pop(ended.worker_id, None)
        self._stops_sent.pop(ended.worker_id, None)
        self._served.discard(ended.worker_id)

    def _learn_events(self) -> None:
        assert self._events_cursor is not None
        for entry_id, event in self.store.run(control.read_events(self.keys, self._events_cursor)):
            self._events_cursor = entry_id
            kind, function, wid = event.get("kind"), event.get("function", ""), event.get("worker", "")
            if kind == control.BOUND and function:
                self._binds.pop(wid, None)
                self._served.add(wid)  # it reached serving: a later crash is not a failed start
                self.store.run(
                    control.set_status(
                        self.keys, function,
                        last_cold_start_ms=event.get("ms", ""), last_cold_path=event.get("path", ""),
                        last_cold_at_ms=int(time.time() * 1000), start_failures=0, wait_reason=None,
                    )
                )  # fmt: skip
                path = event.get("path") or "unknown"
                self.metrics.cold_starts.labels(path).inc()
                with contextlib.suppress(ValueError):  # a malformed ms field is not worth a failed round
                    self.metrics.cold_start_seconds.labels(path).observe(float(event.get("ms") or 0) / 1000)
            elif kind in (control.BIND_FAILED, control.START_FAILED) and function:
                self._binds.pop(wid, None)
                self._failed(function, event.get("reason", kind))

    def _failed(self, function: str, reason: str) -> None:
        log.error("controller: start of %s failed: %s", function, reason)
        self.metrics.start_failures.inc()
        self.store.run(control.add_status_count(self.keys, function, "start_failures"))
        self.store.run(
            control.set_status(
                self.keys, function, last_failure=reason[:500], last_failure_at_ms=int(time.time() * 1000)
            )
        )

    def _with_pending_binds(self, snapshot):  # type: ignore[no-untyped-def]
        """A standby told to bind still heartbeats as standby for a moment: count it as bound already."""
        now = time.monotonic()
        for wid, pending in list(self._binds.items()):
            if now - pending.sent_at > self.config.bind_timeout_s:
                log.warning("controller: bind of %s to %s was never confirmed", wid, pending.function)
                del self._binds[wid]
        if not self._binds:
            return snapshot
        patched = []
        for w in snapshot.workers:
            pending = self._binds.get(w.id)
            if pending is not None and w.state == "standby":
                w = dataclasses.replace(w, state="bound", function=pending.function, running=1)
            elif pending is not None and w.state == "bound":
                del self._binds[w.id]  # its heartbeat says bound: confirmed
            patched.append(w)
        return dataclasses.replace(snapshot, workers=tuple(patched))

    # -- carrying the plan out -------------------------------------------------------------------
    def _apply(self, plan: Plan) -> None:
        waiting: set[str] = set()
        for action in plan.actions:
            if isinstance(action, Stop):
                log.info("controller: stop %s (%s) %s", action.worker_id, action.reason, action.detail)
                self.metrics.stops.labels(action.reason).inc()
                self.store.run(
                    workers.send_control(self.keys, action.worker_id, "stop", reason=action.reason)
                )
                self.executor.stop(action.worker_id)
            elif isinstance(action, Start):
                wid = self._new_worker_id(action)
                what = (
                    f"for {action.function}"
                    if action.function
                    else f"standby ({action.shape or 'any shape'})"
                )
                log.info("controller: start %s on %s %s: %s", wid, action.gpu, what, action.reason)
                self.metrics.starts.labels("bound" if action.function else "standby").inc()
                self.executor.start(action, wid)
            elif isinstance(action, Bind):
                log.info("controller: bind %s -> %s", action.worker_id, action.function)
                self.metrics.binds.inc()
                self._binds[action.worker_id] = _PendingBind(action.function, time.monotonic())
                self.store.run(
                    workers.send_control(self.keys, action.worker_id, "bind", function=action.function)
                )
            elif isinstance(action, Wait):
                waiting.add(action.function)
                self.store.run(control.set_status(self.keys, action.function, wait_reason=action.reason))
        for function, problem in self.reader.problems.items():
            waiting.add(function)
            # `problem`: no worker can start until the function changes; the gateway refuses at once
            self.store.run(control.set_status(self.keys, function, wait_reason=problem, problem=problem))
        # a fixed function's problem goes (all of them on a fresh controller's first round: one round trip)
        solved = (set(self.reader.records) if self._problems is None else self._problems) - set(
            self.reader.problems
        )
        if solved:
            self.store.run(combine(*(control.set_status(self.keys, f, problem=None) for f in sorted(solved))))
        self._problems = set(self.reader.problems)
        for function in self._waiting - waiting:
            self.store.run(control.set_status(self.keys, function, wait_reason=None))
        self._waiting = waiting
        self.store.run(
            control.set_pool(
                self.keys, {control.pool_key(t.gpu, t.backbone, t.shape): t.count for t in plan.pool}
            )
        )

    def _new_worker_id(self, action: Start) -> str:
        self._counter += 1
        gpu = "".join(c if c.isalnum() else "-" for c in action.gpu)
        return f"w-{gpu}-{os.getpid()}-{self._counter}-{os.urandom(2).hex()}"
