"""The controller's driver: each round, read Redis into a `Snapshot`, let the pure policy `decide`, and
carry the plan out. One driver for both modes; what differs is the `Executor` that starts and stops
worker processes (`lorafn up`: child processes; Kubernetes: desired pod counts for the operator).

A round, in order:
1. Hold the lease (one active controller per deployment); a standby controller only renews its claim.
2. Learn what happened since the last round: processes that ended (the executor), and the workers'
   lifecycle events (a standby bound in N ms; a bind failed). A worker that died before serving counts
   as a failed start of its function (exponential backoff in the policy, the reason in its status).
3. Snapshot (Redis + the executor's starting workers + binds sent but not yet confirmed), `decide`.
4. Apply: Park first, synchronously (`PolicyConfig.park_idle`: a `park` control command to each idle
   bound worker the plan parks, then up to ``park_timeout_s`` for its `parked` or `park_refused` lifecycle
   event: the plan counts that memory free for the actions after it; where a park was refused or not
   answered, the Start or Unpark it made room for (`actions.unbacked`) is dropped this round and the next
   one re-plans from fresh heartbeats, the plan's other actions go on); then Stop (a `stop` control
   command: the worker drains and exits), Start (the executor),
   Bind (a `bind` control command to the standby), Unpark (an `unpark` control command: the parked worker
   takes its KV cache back; counted in the account at once, as a Bind, no wait), Preload (a `preload`
   control command: the standby loads that function's adapter and stays a standby), Wait (the reason into
   the function's status, where the gateway and `lorafn status` read it); write the pool targets.

Between rounds the driver waits on the demand stream (`wait_for_demand`, the one wait both `lorafn up`'s
supervisor and the Kubernetes loop use). Demand for a function with no live worker is answered at once
from the last round's snapshot (`policy.fast_binds`: bind a standby, pre-loaded with it first), before
the full round that follows: the request waits for one Redis write, not for a snapshot and a plan. Demand
for a function whose workers are all parked (the parked worker records it: it reads no requests) is
answered the same way (`policy.fast_unparks`: an Unpark, after the Parks that make room for it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import socket
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from lorafn.controller.metrics import ControllerMetrics
from lorafn.controller.policy.actions import (
    Bind,
    Park,
    Plan,
    Preload,
    ResizeKV,
    Start,
    Stop,
    Unpark,
    Wait,
    unbacked,
)
from lorafn.controller.policy.config import PolicyConfig
from lorafn.controller.policy.decide import decide, fast_binds, fast_unparks
from lorafn.controller.policy.model import GPU, Snapshot, Worker
from lorafn.controller.snapshot import SizingConfig, SnapshotReader
from lorafn.controller.waits import WaitTracker
from lorafn.store import UNAVAILABLE_ERRORS, Keys, Store, combine, control, workers
from lorafn.store.streams import entry_ms

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

    # True when `exits()` reports every worker's end, clean ones too (`lorafn up` reaps its processes): then a
    # stopped worker's memory counts as held until its exit is reported. Kubernetes reports only failed
    # containers (operator.reducers), so there a stopped worker counts as gone once it deregisters (a pod's
    # start takes seconds anyway). Read with getattr: False when an executor does not say.
    reports_every_exit: bool


@dataclass
class ControllerConfig:
    interval_s: float = 0.5
    lease_ttl_s: float = 10.0
    bind_timeout_s: float = 60.0  # a bind not confirmed by then is forgotten (the worker died, or lost it)
    heartbeat_ttl_s: float = 5.0
    holder: str = field(default_factory=lambda: f"{socket.gethostname()[:40]}-{os.getpid()}")
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # answer demand from the last snapshot before the full round (off: the round alone, as before; the
    # bench's "before" row)
    fast_bind: bool = True
    preload_timeout_s: float = 30.0  # a preload not seen in the standby's heartbeat by then is sent again
    # a new standby (the pool's refill) on a GPU where a standby was just bound starts this much later: its
    # start and warm-up (forward passes, graph capture) would compete with the bound worker's first
    # prefill (seen on CPU: a pre-loaded bind of 3 ms, then 3.9 s to the first token while two refills
    # warmed up). Deferred at most this long in a row, so a stream of binds never starves the pool.
    refill_delay_s: float = 2.0
    # a pre-loaded standby takes its function's first request itself (it watches the request stream and
    # registers as the function's worker while the function has none: no bind round through the
    # controller inside the cold start); off: it waits for the bind as before (the bench's "before" row)
    preload_claims: bool = True
    # how long a Park waits for the worker's `parked` / `park_refused` event (a worker reads its control
    # stream every ~0.1 s); unanswered by then: what it made room for waits for the next round
    park_timeout_s: float = 2.0
    # a worker that refused a park for another reason than being busy (graph archives, draining, an engine
    # that cannot park), or did not answer, is planned no park for this long (it may still be stopped): else
    # every round under pressure would park it again and drop what the park made room for again
    park_retry_s: float = 30.0
    # a round longer than this is logged with its parts (read, decide, apply): a cold start's decision
    # waits for the round, and the H100 replays showed decision waits that nothing else in the log explained
    slow_round_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.park_timeout_s > 0:
            raise ValueError(f"ControllerConfig.park_timeout_s must be > 0, got {self.park_timeout_s!r}")
        if not self.park_retry_s >= 0:
            raise ValueError(f"ControllerConfig.park_retry_s must be >= 0, got {self.park_retry_s!r}")


@dataclass
class _PendingBind:
    function: str
    sent_at: float


@dataclass
class _PendingPark:
    """A park the worker acknowledged (or an unpark sent) that its heartbeat does not show yet: when, and
    the bytes it moves in the account (`Park.release_bytes`, `Unpark.mem_bytes`)."""

    sent_at: float
    bytes: int


@dataclass
class _Stopped:
    """A worker told to stop, until its exit is reported (or `bind_timeout_s` passed): when the stop went
    out, the function it made room for ("" = none) and its last record (GPU, memory; None when the plan's
    snapshot did not have it)."""

    sent_at: float
    room_for: str = ""
    last: Worker | None = None


@dataclass(frozen=True)
class Demand:
    """One demand record the gateway wrote: a request for ``function`` found no live worker at server time
    ``at_ms``."""

    function: str
    at_ms: int


FRESH_STARTS_KEPT = 9


class Controller:
    def __init__(
        self, store: Store, keys: Keys, executor: Executor, sizing: SizingConfig, config: ControllerConfig
    ) -> None:
        self.store, self.keys, self.executor, self.config = store, keys, executor, config
        self.reader = SnapshotReader(store, keys, sizing, config.heartbeat_ttl_s)
        self._binds: dict[str, _PendingBind] = {}
        # joins sent to bound workers with a free adapter slot (Bind.join), until their heartbeat lists the
        # function: (worker, function) -> when sent
        self._joins: dict[tuple[str, str], float] = {}
        self._events_cursor: str | None = None
        self._counter = 0
        self._waiting: set[str] = set()
        self._wait_tracker = WaitTracker()
        self._problems: set[str] | None = None  # functions whose status holds a `problem` (None: unknown)
        # workers that reached serving (a `bound` event): a later crash is not a failed start
        self._served: set[str] = set()
        # workers told to stop whose exit the executor has not reported: one stop command per worker, not
        # one per round, and their memory held until then, also after they deregistered (the process tears
        # its CUDA context down last)
        self._stops_sent: dict[str, _Stopped] = {}
        # demand entries after this one wake the loop (None: from the first wait on)
        self.demand_cursor: str | None = None
        self._exits: list[Exit] = []  # ended workers not yet learned from
        # function -> when its oldest unanswered demand was recorded (server ms): request -> bind latency
        self._demand_at: dict[str, int] = {}
        self._unanswered: list[Demand] = []  # demand read inside a round that no standby took
        self._wake_cursor: str | None = None  # lifecycle events after this one end a wait
        # standby id -> (function, sent at): preloads not yet seen in the standby's heartbeat
        self._preloads: dict[str, _PendingBind] = {}
        self._bound_at: dict[str, float] = {}  # GPU -> when a bind was last sent there (monotonic)
        # parks the worker acknowledged and unparks sent, until its heartbeat says so (`parked`): the plans
        # in between count them as done (its memory freed / taken back), and send neither again
        self._parks: dict[str, _PendingPark] = {}
        self._unparks: dict[str, _PendingPark] = {}
        # KV budgets sent, not yet in the worker's heartbeat: the action and when it was sent
        self._resizes: dict[str, tuple[ResizeKV, float]] = {}
        self._park_held: dict[str, float] = {}  # worker -> until when no park is planned for it (monotonic)
        self._deferred_since: dict[str, float] = {}  # GPU -> since when its refill waits
        self.last_plan: Plan | None = None
        self.last_snapshot: Snapshot | None = None
        # the same as read from Redis, before this driver's pending binds, stops and parks patched it: the
        # fast path patches it again with what is pending then (patching a patched one would take its own
        # patches for the heartbeats' confirmations)
        self._last_read: Snapshot | None = None
        # the last fresh starts (spawn -> serving, s): their median replaces the configured fresh_start_s,
        # which sizes the pool's refill window and how long a cold start may wait on a warming standby
        self._fresh_starts: deque[float] = deque(maxlen=FRESH_STARTS_KEPT)
        self.metrics = ControllerMetrics()

    # -- one round -------------------------------------------------------------------------------
    def round(self) -> Plan | None:
        """One decision round; None when another controller holds the lease."""
        ttl_ms = int(self.config.lease_ttl_s * 1000)
        if not self.store.run(control.acquire_lease(self.keys, self.config.holder, ttl_ms)):
            return None
        t0 = time.perf_counter()
        self._learn()
        # Demand recorded while a round runs is answered between its steps (one non-blocking read each),
        # not after it: a round takes tens of ms (more on a busy host).
        self._answer_recorded_demand()
        snapshot = self.reader.read(self.executor.gpus(), self.executor.starting())
        self._answer_recorded_demand()  # before the pending binds patch this round's snapshot
        read = snapshot
        snapshot = self._with_pending_binds(snapshot)
        for w in snapshot.workers:  # demand of a function that has a worker is answered (or never needed one)
            if w.function:
                self._demand_at.pop(w.function, None)
        t_read = time.perf_counter()
        plan = decide(snapshot, self.config.policy)
        t_decide = time.perf_counter()
        self._apply(plan, snapshot)
        self.last_plan, self.last_snapshot, self._last_read = plan, snapshot, read
        self._answer_recorded_demand()
        m = self.metrics
        m.pool_target.set(sum(t.count for t in plan.pool))
        m.pool_standby.set(sum(1 for w in snapshot.workers if w.state == "standby"))
        m.observe_gpus((g.id for g in snapshot.gpus), snapshot.workers)
        m.waiting.set(len(self._waiting))
        end = time.perf_counter()
        m.rounds.observe(end - t0)
        if end - t0 > self.config.slow_round_s:
            log.warning(
                "controller: slow round %.2f s (read %.2f, decide %.2f, apply %.2f; %d actions, %d workers)",
                end - t0, t_read - t0, t_decide - t_read, end - t_decide, len(plan.actions),
                len(snapshot.workers),
            )  # fmt: skip
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
            try:
                self.answer_demand(self.wait_for_demand(self.config.interval_s))
            except UNAVAILABLE_ERRORS as e:
                log.warning("controller: Redis unreachable (%s); retrying", e)
                time.sleep(self.config.interval_s)

    def wait_for_demand(self, timeout_s: float | None) -> list[Demand]:
        """Wait up to `timeout_s` for the gateway to record cold-start demand (a request that found no live
        worker); what was recorded (empty on timeout; None: do not wait). A worker's lifecycle event (bound,
        failed) also ends the wait, with nothing to answer: the round that follows puts it in the function's
        status at once. Demand read inside the last round that no standby could take is returned at once
        (the next round must not wait an interval for it). Redis errors are raised: the caller decides (the
        Kubernetes loop logs and sleeps; `lorafn up`'s supervisor checks its Redis server)."""
        if self._unanswered:
            out, self._unanswered = self._unanswered, []
            return out
        if self.demand_cursor is None or self._wake_cursor is None:  # from now on (a stream id from
            # Redis's clock, not "$", so that what is recorded while a round runs still wakes the next wait)
            now = f"{self.store.run(workers.server_time_ms())}-0"
            self.demand_cursor = self.demand_cursor or now
            self._wake_cursor = now
        block_ms = None if timeout_s is None else max(1, int(timeout_s * 1000))
        entries, events = self.store.run(
            control.read_demand_and_events(self.keys, self.demand_cursor, self._wake_cursor, block_ms)
        )
        if events:
            self._wake_cursor = events[-1][0]
        out = []
        for entry_id, fields in entries:
            self.demand_cursor = entry_id
            function = fields.get("function", "")
            if function:
                at_ms = int(entry_id.split("-", 1)[0])
                with contextlib.suppress(ValueError):
                    at_ms = int(fields.get("at") or at_ms)
                out.append(Demand(function, at_ms))
        return out

    def _answer_recorded_demand(self) -> None:
        """Inside a round: answer demand recorded since the last read (no wait); what no standby took is
        kept for the next `wait_for_demand`, which returns it at once."""
        if not self.config.fast_bind or self.last_snapshot is None or self.demand_cursor is None:
            return
        demand = self.wait_for_demand(None)
        if demand:
            answered = {a.function for a in self.answer_demand(demand)}
            self._unanswered.extend(d for d in demand if d.function not in answered)

    def answer_demand(self, demand: list[Demand]) -> list[Bind | Unpark]:
        """Bind standbys to the functions of `demand` that have no live worker, and unpark a parked worker
        of those whose workers are all parked (`fast_unparks`; the Parks that make room for it first, as in
        a round), from the last round's snapshot (no new snapshot, no plan): milliseconds after the request
        instead of a round. The full round that follows sees these binds and unparks as pending. Nothing
        before the first round, or when the lease is another controller's (that one answers)."""
        for d in demand:
            self._demand_at.setdefault(d.function, d.at_ms)
        if not demand or not self.config.fast_bind or self.last_snapshot is None:
            return []
        ttl_ms = int(self.config.lease_ttl_s * 1000)
        if not self.store.run(control.acquire_lease(self.keys, self.config.holder, ttl_ms)):
            # another controller leads now: its view, not our old one
            self.last_snapshot = self._last_read = None
            return []
        # stopped ones count as draining, parks acknowledged as parked, ...
        snapshot = self._with_pending_binds(self._last_read or self.last_snapshot)
        functions = {d.function for d in demand}
        binds = fast_binds(snapshot, functions, self.config.policy)
        for bind in binds:
            self._send_bind(bind, fast=True)
        answered: list[Bind | Unpark] = list(binds)
        actions = fast_unparks(snapshot, functions, self.config.policy)
        if actions:
            failed = self._apply_parks([a for a in actions if isinstance(a, Park)], fast=True)
            dropped = unbacked(actions, failed)
            for a in actions:
                if isinstance(a, Unpark) and not any(a is d for d in dropped):
                    self._send_unpark(a, fast=True)
                    answered.append(a)
        return answered

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
            self._learn_event(entry_id, event)

    def _learn_event(self, entry_id: str, event: dict[str, str]) -> None:
        """One lifecycle event (the cursor moves past it). Parking answers are awaited where a park is
        sent (`_apply_parks`); one read here came after its wait gave up."""
        self._events_cursor = entry_id
        kind, function, wid = event.get("kind"), event.get("function", ""), event.get("worker", "")
        if kind in (control.PARKED, control.PARK_REFUSED):  # the park's wait had given up on it
            log.info("controller: late answer to a park: %s %s (%s)", wid, kind, event.get("reason", ""))
            if kind == control.PARKED:  # it can park after all (its heartbeat will say it is parked)
                self._park_held.pop(wid, None)
            return
        if kind == control.UNPARKED:
            log.info("controller: %s unparked (%s, KV %s bytes)", wid, function, event.get("kv_bytes", "?"))
            return
        if kind == control.BOUND and function:
            self._binds.pop(wid, None)
            self._demand_at.pop(function, None)
            self._served.add(wid)  # it reached serving: a later crash is not a failed start
            self.store.run(
                control.set_status(
                    self.keys, function,
                    last_cold_start_ms=event.get("ms", ""), last_cold_path=event.get("path", ""),
                    last_cold_preloaded=event.get("preloaded", "0"),
                    last_cold_claimed=event.get("claimed", "0"),
                    last_cold_at_ms=int(time.time() * 1000), start_failures=0, wait_reason=None,
                )
            )  # fmt: skip
            path = event.get("path") or "unknown"
            self.metrics.cold_starts.labels(path).inc()
            with contextlib.suppress(ValueError):  # a malformed ms field is not worth a failed round
                seconds = float(event.get("ms") or 0) / 1000
                self.metrics.cold_start_seconds.labels(path).observe(seconds)
                if path == "fresh" and seconds > 0:
                    self._learn_fresh_start(seconds)
        elif kind in (control.BIND_FAILED, control.START_FAILED) and function:
            self._binds.pop(wid, None)
            self._joins.pop((wid, function), None)
            self._failed(function, event.get("reason", kind))

    def _learn_fresh_start(self, seconds: float) -> None:
        """A measured fresh start: the policy's fresh_start_s becomes the median of the last few (the
        configured default, 20 s on a GPU, was the spawn of a bare process; from the zygote with the
        backbone resident a 7B worker serves in ~1.7 s, and slower while many start at once)."""
        self._fresh_starts.append(seconds)
        estimate = statistics.median(self._fresh_starts)
        sizing = self.reader.sizing
        if abs(estimate - sizing.fresh_start_s) > 0.1 * sizing.fresh_start_s:
            log.info("controller: fresh start estimate %.2f s -> %.2f s", sizing.fresh_start_s, estimate)
        self.reader.sizing = dataclasses.replace(sizing, fresh_start_s=estimate)
        self.metrics.fresh_start_estimate.set(estimate)

    def _failed(self, function: str, reason: str) -> None:
        log.error("controller: start of %s failed: %s", function, reason)
        self.metrics.start_failures.inc()
        self.store.run(
            control.record_start_failure(self.keys, function, reason[:500], int(time.time() * 1000))
        )

    def _with_pending_binds(self, snapshot):  # type: ignore[no-untyped-def]
        """A standby told to bind still heartbeats as standby for a moment: count it as bound already."""
        now = time.monotonic()
        for wid, pending in list(self._binds.items()):
            if now - pending.sent_at > self.config.bind_timeout_s:
                log.warning("controller: bind of %s to %s was never confirmed", wid, pending.function)
                del self._binds[wid]
        for key, sent_at in list(self._joins.items()):
            if now - sent_at > self.config.bind_timeout_s:
                log.warning("controller: join of %s into %s was never confirmed", key[1], key[0])
                del self._joins[key]
        for wid, pending in list(self._preloads.items()):
            if now - pending.sent_at > self.config.preload_timeout_s:
                del self._preloads[wid]  # not seen in its heartbeat: the next plan may send it again
        for wid, stopped in list(self._stops_sent.items()):
            # still there, or its exit never reported: let the policy see it again
            if now - stopped.sent_at > self.config.bind_timeout_s:
                del self._stops_sent[wid]
        for wid, until in list(self._park_held.items()):
            if now >= until:
                del self._park_held[wid]
        for pending_parks in (self._parks, self._unparks):
            for wid, parking in list(pending_parks.items()):
                if now - parking.sent_at > self.config.bind_timeout_s:  # never seen: its heartbeat decides
                    del pending_parks[wid]
        for wid, (_, sent_at) in list(self._resizes.items()):
            if now - sent_at > self.config.bind_timeout_s:  # refused or lost: its heartbeat decides
                del self._resizes[wid]
        if not (
            self._binds
            or self._joins
            or self._preloads
            or self._stops_sent
            or self._parks
            or self._unparks
            or self._park_held
            or self._resizes
        ):
            return snapshot
        patched = []
        seen = {w.id for w in snapshot.workers}
        for wid, stopped in self._stops_sent.items():
            # deregistered, its process not yet gone (where the executor says when it is): memory held
            if (
                wid not in seen
                and stopped.last is not None
                and getattr(self.executor, "reports_every_exit", False)
            ):
                # (a parked one drains at its parked size)
                w = dataclasses.replace(
                    stopped.last, state="draining", running=0, preloaded=None, parked=False
                )
                patched.append(dataclasses.replace(w, room_for=stopped.room_for or None))
        for w in snapshot.workers:
            pending = self._binds.get(w.id)
            if pending is not None and w.state == "standby":
                w = dataclasses.replace(
                    w, state="bound", function=pending.function, running=1, preloaded=None
                )
            elif pending is not None and w.state == "bound":
                del self._binds[w.id]  # its heartbeat says bound: confirmed
            w = self._with_pending_joins(w)
            stopped = self._stops_sent.get(w.id)
            if stopped is not None and w.state in ("standby", "bound", "starting"):
                # told to stop, still heartbeating (or starting) for a moment: its memory is held, but it
                # is neither bound nor stopped again (a bind sent now would follow the stop and be lost)
                w = dataclasses.replace(w, state="draining", running=0, preloaded=None, parked=False)
            if stopped is not None and stopped.room_for and w.state == "draining":
                # stopped to make room for a function: that function waits for this memory (policy
                # `room_coming`) instead of the next rounds offloading more for it
                w = dataclasses.replace(w, room_for=stopped.room_for)
            w = self._with_pending_park(w)
            w = self._with_pending_resize(w)
            if w.id in self._park_held and w.parkable:
                w = dataclasses.replace(w, parkable=False)
            preload = self._preloads.get(w.id)
            if preload is not None and w.state == "standby":
                if w.preloaded == preload.function:
                    del self._preloads[w.id]  # its heartbeat says so: confirmed
                else:  # sent, not yet loaded: plan as if it were (no second command)
                    w = dataclasses.replace(w, preloaded=preload.function)
            patched.append(w)
        return dataclasses.replace(snapshot, workers=tuple(patched))

    def _with_pending_joins(self, w: Worker) -> Worker:
        """``w`` with the functions joined into its adapter slots that its heartbeat does not list yet (the
        next round must neither join another function into that slot nor start a worker for them)."""
        if not self._joins or w.state != "bound":
            return w
        for (wid, function), _ in list(self._joins.items()):
            if wid != w.id:
                continue
            if function in w.functions:
                del self._joins[(wid, function)]  # its heartbeat lists it: confirmed
            else:
                w = dataclasses.replace(
                    w,
                    joined=(*w.joined, function),
                    free_slots=max(0, w.free_slots - 1),
                    running=max(1, w.running),
                )
        return w

    def _with_pending_park(self, w: Worker) -> Worker:
        """``w`` as a park it acknowledged, or an unpark sent to it, left it (its heartbeat, up to a second
        old, may not show it yet): parked, charged its release less; unparked, charged it back and busy
        (its function's request is on its way to it: neither parked nor stopped again meanwhile)."""
        park, unpark = self._parks.get(w.id), self._unparks.get(w.id)
        if park is not None:
            if w.parked or w.state != "bound" or w.running > 0:
                del self._parks[w.id]  # its heartbeat says parked (or it is no longer an idle bound one)
            else:
                return dataclasses.replace(
                    w, parked=True, mem_bytes=max(0, w.mem_bytes - park.bytes), release_bytes=park.bytes
                )
        if unpark is not None:
            if not w.parked:
                del self._unparks[w.id]  # its heartbeat says unparked
            else:
                return dataclasses.replace(
                    w, parked=False, mem_bytes=w.mem_bytes + unpark.bytes, release_bytes=unpark.bytes,
                    running=max(1, w.running),
                )  # fmt: skip
        return w

    def _with_pending_resize(self, w: Worker) -> Worker:
        """``w`` as a KV budget sent to it will leave it (its heartbeat may not show it yet): a grant is
        charged at once (the next round must not give that memory away again); a return is counted free only
        once the worker reports it (its memory is held until the cache is resized)."""
        pending = self._resizes.get(w.id)
        if pending is None:
            return w
        resize = pending[0]
        if w.kv_bytes == resize.kv_bytes or w.state != "bound" or w.parked:
            del self._resizes[w.id]  # its heartbeat says so (or it moved on)
            return w
        if resize.delta_bytes > 0:
            return dataclasses.replace(
                w, mem_bytes=w.mem_bytes + resize.delta_bytes, kv_bytes=resize.kv_bytes, kv_grant=True
            )
        return dataclasses.replace(w, kv_bytes=resize.kv_bytes, kv_grant=False)

    def _send_resize(self, action: ResizeKV) -> None:
        """A ResizeKV: the `kv_budget` command; the worker resizes between steps and answers `kv_resized`
        (or `kv_resize_refused`, e.g. a block in use above a smaller size: the next round asks again)."""
        self.store.run(workers.send_control(self.keys, action.worker_id, "kv_budget", bytes=action.kv_bytes))
        self._resizes[action.worker_id] = (action, time.monotonic())
        self.metrics.kv_resizes.labels("grow" if action.delta_bytes > 0 else "shrink", action.cause).inc()
        log.info("controller: KV budget of %s (%s on %s): %s", action.worker_id, action.function, action.gpu,
                 action.detail)  # fmt: skip

    # -- carrying the plan out -------------------------------------------------------------------
    def _apply(self, plan: Plan, snapshot: Snapshot | None = None) -> None:
        waits: dict[str, tuple[str, str]] = {}  # function -> (cause, reason) of this round's Waits
        by_id = {w.id: w for w in snapshot.workers} if snapshot is not None else {}
        # Parks first, synchronously: the plan counts their memory free for the actions after them
        failed = self._apply_parks([a for a in plan.actions if isinstance(a, Park)], fast=False)
        # what counted on a park that did not happen waits for the next round; the rest goes on
        dropped = unbacked(plan.actions, failed)
        for action in plan.actions:
            if isinstance(action, Park):
                continue
            if any(action is d for d in dropped):
                log.info("controller: %r dropped this round: a park making its room did not happen", action)
                continue
            if isinstance(action, Stop):
                log.info("controller: stop %s (%s) %s", action.worker_id, action.reason, action.detail)
                self.metrics.stops.labels(action.reason).inc()
                if action.reason == "offload":
                    self.metrics.offloads.labels(action.cause or "unknown", action.victim or "unknown").inc()
                self.store.run(
                    workers.send_control(self.keys, action.worker_id, "stop", reason=action.reason)
                )
                self._stops_sent[action.worker_id] = _Stopped(
                    time.monotonic(), action.room_for, by_id.get(action.worker_id)
                )
                self.executor.stop(action.worker_id)
            elif isinstance(action, Start):
                if action.function is None and self._defer_refill(action.gpu):
                    continue  # planned again next round
                wid = self._new_worker_id(action)
                what = (
                    f"for {action.function}"
                    if action.function
                    else f"standby ({action.shape or 'any shape'})"
                )
                log.info("controller: start %s on %s %s: %s", wid, action.gpu, what, action.reason)
                if action.function:
                    self._demand_at.pop(action.function, None)  # answered by a fresh start
                self.metrics.starts.labels("bound" if action.function else "standby").inc()
                self.executor.start(action, wid)
            elif isinstance(action, Bind):
                self._send_bind(action, fast=False)
            elif isinstance(action, Preload):
                log.info(
                    "controller: preload %s into standby %s (value %.3g s/s)",
                    action.function, action.worker_id, action.value,
                )  # fmt: skip
                self.metrics.preloads.inc()
                self._preloads[action.worker_id] = _PendingBind(action.function, time.monotonic())
                self.store.run(
                    workers.send_control(
                        self.keys,
                        action.worker_id,
                        "preload",
                        function=action.function,
                        claim=int(self.config.preload_claims),
                    )
                )
            elif isinstance(action, Unpark):
                self._send_unpark(action, fast=False)
            elif isinstance(action, ResizeKV):
                if action.delta_bytes > 0 and action.worker_id in self._resizes:
                    # its last budget is not confirmed yet: the queue that asked for more may be what the
                    # worker reads once resized (the next round asks again if it is still there)
                    continue
                self._send_resize(action)
            elif isinstance(action, Wait):
                waits[action.function] = (action.cause, action.reason)
                self.store.run(control.set_status(self.keys, action.function, wait_reason=action.reason))
        waiting = set(waits)  # and the functions with a problem, below
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
        self._log_waits(waits)
        self.store.run(
            control.set_pool(
                self.keys, {control.pool_key(t.gpu, t.backbone, t.shape): t.count for t in plan.pool}
            )
        )

    def _log_waits(self, waits: dict[str, tuple[str, str]]) -> None:
        """A line when a function starts waiting for a worker, when what it waits for changes and when it
        stops waiting; the seconds each cause lasted go to `lorafn_controller_wait_seconds_total`."""
        for step in self._wait_tracker.update(waits, time.monotonic()):
            if step.ended is not None:
                self.metrics.wait_seconds.labels(step.ended).inc(step.seconds)
            if step.cause is None:
                log.info(
                    "controller: waited %s %.2f s (last %s %.2f s)",
                    step.function, step.total_s, step.ended, step.seconds,
                )  # fmt: skip
            elif step.ended is None:
                log.info("controller: wait %s (%s): %s", step.function, step.cause, step.reason)
            else:
                log.info(
                    "controller: wait %s (%s, after %s %.2f s): %s",
                    step.function, step.cause, step.ended, step.seconds, step.reason,
                )  # fmt: skip

    def _defer_refill(self, gpu: str) -> bool:
        """Whether a standby start on `gpu` waits (a bind there is younger than `refill_delay_s`)."""
        now, delay = time.monotonic(), self.config.refill_delay_s
        if now - self._bound_at.get(gpu, -1e18) >= delay:
            self._deferred_since.pop(gpu, None)
            return False
        since = self._deferred_since.get(gpu)
        if since is None:  # logged once per deferral, not every round of it (~8 lines a second)
            since = self._deferred_since[gpu] = now
            log.info(
                "controller: standby starts on %s deferred up to %.1f s: a worker there was just bound",
                gpu,
                delay,
            )
        return now - since < delay

    def _send_bind(self, action: Bind, fast: bool) -> None:
        entry_id = self.store.run(
            workers.send_control(self.keys, action.worker_id, "bind", function=action.function)
        )
        if action.join:  # a bound worker takes it into a free adapter slot: no standby used up
            self._joins[(action.worker_id, action.function)] = time.monotonic()
        else:
            self._binds[action.worker_id] = _PendingBind(action.function, time.monotonic())
            self._bound_at[action.gpu] = time.monotonic()
            self._preloads.pop(action.worker_id, None)
        self.metrics.binds.labels("fast" if fast else "round", "yes" if action.preloaded else "no").inc()
        # request -> bind command, both on Redis's clock (the control entry's id is its server time)
        at_ms = self._demand_at.pop(action.function, None)
        waited = ""
        if at_ms is not None:
            ms = max(0, int(str(entry_id).split("-", 1)[0]) - at_ms)
            self.metrics.demand_to_bind.labels("fast" if fast else "round").observe(ms / 1000)
            waited = f", {ms} ms after its demand"
        log.info(
            "controller: %s %s -> %s (%s%s%s)",
            "join" if action.join else "bind", action.worker_id, action.function,
            "fast path" if fast else "round", ", adapter pre-loaded" if action.preloaded else "", waited,
        )  # fmt: skip

    def _apply_parks(self, parks: list[Park], fast: bool) -> list[Park]:
        """Send each Park's `park` command and wait up to ``park_timeout_s`` (for all of them together) for
        the workers' answers on the lifecycle stream; the parks refused or not answered (what counted on
        their memory, `unbacked`, waits for the next round). Other events read meanwhile go to the usual
        handling (`_learn_event`): none is lost."""
        if not parks:
            return []
        if self._events_cursor is None:
            self._events_cursor = self.store.run(control.last_event_id(self.keys))
        path = "fast" if fast else "round"
        t0 = time.monotonic()
        # the worker's keep-alive while parked comes with the command (the policy's; "inf": never; none:
        # the function's), so the worker exits when the policy would retire it
        keep = self.config.policy.parked_keep_alive_s
        extra = {} if keep is None else {"keep_alive_s": "inf" if math.isinf(keep) else repr(float(keep))}
        ids = self.store.run(
            combine(*(workers.send_control(self.keys, p.worker_id, "park", **extra) for p in parks))
        )
        # an answer counts when it came after its command (both ids are on Redis's clock): an older one
        # (a park before, answered after its wait gave up) is not this one's
        sent = {p.worker_id: (p, entry_ms(entry_id)) for p, entry_id in zip(parks, ids, strict=True)}
        answers: dict[str, dict[str, str]] = {}
        deadline = t0 + self.config.park_timeout_s
        while len(answers) < len(sent):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            # a second at most per read: a park_timeout_s above the client's socket timeout is no error
            block_ms = min(left_ms, 1000)
            entries = self.store.run(control.read_events(self.keys, self._events_cursor, block_ms=block_ms))
            for entry_id, event in entries:
                wid = event.get("worker", "")
                if (
                    event.get("kind") in (control.PARKED, control.PARK_REFUSED)
                    and wid in sent
                    and entry_ms(entry_id) >= sent[wid][1]
                ):
                    self._events_cursor = entry_id
                    answers[wid] = event
                else:
                    self._learn_event(entry_id, event)
        waited = time.monotonic() - t0
        self.metrics.park_wait_seconds.observe(waited)
        failed: list[Park] = []
        for wid, (park, _) in sent.items():
            event = answers.get(wid)
            if event is not None and event.get("kind") == control.PARKED:
                self.metrics.parks.labels(path).inc()
                self._parks[wid] = _PendingPark(time.monotonic(), park.release_bytes)
                log.info(
                    "controller: parked %s (%s on %s): released %s bytes (planned %d), %s; answer in %.0f ms",
                    wid, park.function, park.gpu, event.get("released_bytes", "?"), park.release_bytes,
                    park.detail, waited * 1000,
                )  # fmt: skip
                continue
            reason = "refused" if event is not None else "timeout"
            self.metrics.park_refusals.labels(reason).inc()
            failed.append(park)
            if event is None or not event.get("reason", "").startswith("busy"):  # not a passing state
                self._park_held[wid] = time.monotonic() + self.config.park_retry_s
            log.warning(
                "controller: park of %s (%s on %s) %s%s: %s waits a round",
                wid, park.function, park.gpu, reason,
                f" ({event.get('reason', '')})" if event is not None else f" after {waited:.1f} s",
                park.room_for or "what its memory was planned for",
            )  # fmt: skip
        return failed

    def _send_unpark(self, action: Unpark, fast: bool) -> None:
        """An Unpark: its memory is the account's at once (`_with_pending_park` until the heartbeat shows
        it); no wait for the `unparked` answer."""
        self.store.run(workers.send_control(self.keys, action.worker_id, "unpark"))
        self._unparks[action.worker_id] = _PendingPark(time.monotonic(), action.mem_bytes)
        self._parks.pop(action.worker_id, None)
        self._demand_at.pop(action.function, None)  # answered
        self.metrics.unparks.labels("fast" if fast else "round").inc()
        log.info(
            "controller: unpark %s (%s on %s, %d bytes back; %s)",
            action.worker_id, action.function, action.gpu, action.mem_bytes, "fast path" if fast else "round",
        )  # fmt: skip

    def _new_worker_id(self, action: Start) -> str:
        self._counter += 1
        gpu = "".join(c if c.isalnum() else "-" for c in action.gpu)
        return f"w-{gpu}-{os.getpid()}-{self._counter}-{os.urandom(2).hex()}"
