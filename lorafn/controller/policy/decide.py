"""One decision round: `decide(snapshot, config) -> Plan`. Deterministic for a given snapshot.

Order of work (each step sees the memory the previous ones granted or freed):

1. **Account** (account.py): each GPU's capacity, use and free bytes.
2. **Retire**: workers of deleted functions and workers above ``max_replicas`` (idle ones only) get
   Stop("scale_down"); idle bound workers past ``keep_alive_s`` (parked ones: past
   ``PolicyConfig.parked_keep_alive_s`` where set) get Stop("keep_alive") while their function keeps
   ``min_replicas`` and has nothing queued; standbys of an unknown backbone, or on a GPU that no longer
   holds it, get Stop("pool_shrink").
3. **Demand**, most urgent first (queued with no worker, by longest wait; then below
   ``min_replicas``; then scale-up when queued per live worker exceeds
   ``scale_up_queue_per_worker``, or, with ``scale_up_wait_fraction``, when the oldest queued request has
   waited that share of its TTFT SLO behind busy workers; one worker per round, never above
   ``max_replicas``). A function in backoff after failed starts gets Wait. Otherwise, per worker needed:
   a. Bind a standby on a GPU holding its backbone with ``mem_bytes`` >= the function's: one that
      pre-loaded its adapter, else one prepared for its shape (one holding no other function's adapter
      first), else a shape-agnostic one, else any (a graph capture on bind; only while that still
      beats a fresh start); the smallest that fits, then the GPU with most free memory;
   b. else wait for a standby that can take it and is warming up (Wait says so);
   b'. else, when no GPU can start it now but workers an earlier round offloaded for it are still
      exiting (``Worker.room_for``) and it fits once they are gone, Wait for them (its memory reserved;
      nothing more is offloaded for it);
   c. else, while every GPU holding the backbone has ``max_fresh_starts_per_gpu`` fresh starts under way
      (starting workers, bound or standby, and this plan's Starts), Wait for a start slot or a standby,
      unless only a start now keeps its oldest request within its TTFT SLO (then it starts over the cap);
   d. else Start a fresh bound worker on the GPU with a start slot and the most free memory;
   e. else offload (offload.py) on the GPU where it loses the least value, and Wait: the Start comes in
      a later round, once the victims' processes have exited (b'), because a process holds its memory
      until it exits and a worker started at once dies of OOM creating its CUDA context (each Stop names
      its cause: a cold start, the min_replicas floor, or a scale-up under a burst); an idle
      bound worker whose function is expected back within ``thrash_horizon_starts`` fresh starts goes
      last, never for a scale-up, and for a cold start only when a start now still meets its request's
      deadline or the request has waited that horizon already;
   f. else Wait with the reason (the GPUs' memory numbers).
   Last, offline batch backlog (``Function.batch_backlog``, docs/batch.md): a function with n live workers
   wants ``n + floor(backlog / batch_backlog_per_worker)`` (up to ``max_replicas``) and binds ready
   standbys for those it lacks (3a only: idle capacity; no start, offload or Wait). Its workers go back by
   keep-alive once the backlog is gone (step 2 keeps an idle one while a backlog is left).
3'. **KV for bursts** (``PolicyConfig.burst_kv_bytes``, off by default): the busy workers of a function whose
   online requests have waited ``burst_kv_min_wait_s`` in its queue grow their KV caches (`ResizeKV`) by their
   share of the queue at their KV per running request, out of what demand left, keeping room for one more
   standby (a worker holds only what its KV serves; a few queued requests never scale a function up).
4. **Warm pool** (planner.py) with the memory and the start slots left.
5. **Pre-loading** (preload.py): which function's adapter each ready standby the plan keeps should hold.
6. **KV for offline batches** (``PolicyConfig.batch_kv_bytes``, off by default): a bound worker of a function
   with a batch backlog grows its KV cache towards that budget (`ResizeKV`) out of what steps 1-5 left free,
   keeping room for one more standby (as much as there is, when at least half its own KV more). A worker
   holding granted KV (batch or burst) shrinks back to its function's own budget once it has been idle
   ``kv_grant_idle_s`` with nothing queued and no backlog.

Parking (``PolicyConfig.park_idle``: off here, on by default in the services; offload.py's docstring): after
step 2, bound workers idle ``park_after_s`` or longer are parked (when set). In step 3, a function whose live
workers are all parked (or too few unparked for its queue) gets an Unpark first: where its KV fits now, or
after parking idle workers on its GPU; else once workers exiting for it are gone (b'); else a ready standby is
bound; else workers are stopped (e) for the unpark's memory, not a whole fresh worker's. Where a fresh start
does not fit (d), idle workers are parked on the GPU where it loses least before any worker is stopped (e). A
Park's memory is free at once in the plan (the driver must apply it synchronously: the worker acknowledges the
release), so the Start or Unpark it makes room for follows in the same plan; a Stop's is not (a process frees
at its exit).

`fast_binds(snapshot, functions)` is step 3a alone for functions whose demand just arrived: the driver
binds from its last snapshot within milliseconds of a request, and the full round follows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Iterable

from lorafn.controller.policy.account import Ledger, MemoryAccount, accounts, gib
from lorafn.controller.policy.actions import (
    Action,
    Bind,
    OffloadCause,
    Park,
    Plan,
    ResizeCause,
    ResizeKV,
    Start,
    Stop,
    Unpark,
    Wait,
)
from lorafn.controller.policy.backoff import backoff_reason, backoff_remaining_s
from lorafn.controller.policy.config import PolicyConfig
from lorafn.controller.policy.model import Function, Snapshot, Worker, shape_holds
from lorafn.controller.policy.offload import (
    candidates,
    choose_parks,
    choose_victims,
    lost_value,
    park_candidates,
    release_bytes,
    served_functions,
)
from lorafn.controller.policy.planner import cold_demand, holds, is_pool_worker, plan_pool, refill_s
from lorafn.controller.policy.preload import plan_preload

# demand urgency (step 3) -> why an offload for it needs room
_CAUSES: tuple[OffloadCause, ...] = ("cold_start", "min_replicas", "scale_up")

MIB = 1 << 20


def _live(w: Worker) -> bool:
    """A worker that serves (or will serve) its function: bound, or starting for it."""
    return w.function is not None and w.state in ("bound", "starting")


class _Round:
    """The mutable state of one `decide` call (kept out of the public functions)."""

    def __init__(self, snapshot: Snapshot, config: PolicyConfig) -> None:
        self.snapshot, self.config, self.costs = snapshot, config, snapshot.costs
        self.account = accounts(snapshot, config.gpu_utilization, config.driver_headroom)
        self.ledger = Ledger({g: a.free_bytes for g, a in self.account.items()})
        self.functions = {f.name: f for f in snapshot.functions}
        self.backbones = {b.name: b for b in snapshot.backbones}
        self.where = holds(snapshot)
        self.actions: list[Action] = []
        self.gone: set[str] = set()  # workers stopped in this plan
        self.protected: set[str] = set()  # workers bound or kept by this plan: never offloaded
        self.claimed: set[str] = set()  # starting standbys a waiting function will bind once they are up
        self.live: dict[str, list[Worker]] = defaultdict(list)
        self.standbys: dict[str, list[Worker]] = defaultdict(list)
        self.on_gpu: dict[str, list[Worker]] = defaultdict(list)
        # fresh starts under way per GPU (processes starting, bound or standby; this plan's Starts added)
        self.starting: dict[str, int] = defaultdict(int)
        self.unparked: set[str] = set()  # parked workers this plan unparks
        self.unpark_tried: set[str] = set()  # parked workers this plan found no memory for (`unpark_path`)
        for w in snapshot.workers:
            self.on_gpu[w.gpu].append(w)
            if w.state == "starting":
                self.starting[w.gpu] += 1
            if _live(w):
                for name in w.functions:  # a worker with adapter slots is the live worker of each
                    self.live[name].append(w)
            elif w.state == "standby":
                self.standbys[w.backbone].append(w)
        self.served: set[str] = set()  # functions given a worker in this plan (or memory it waits for)
        self.room_used: set[str] = set()  # exiting workers whose coming memory a Wait of this plan counts
        self.stopped_for: dict[str, str] = {}  # workers stopped in this plan -> the function it made room for
        # adapter slots this plan's joins took, per worker (docs/runtime.md#adapter-slots)
        self.slots_taken: dict[str, int] = defaultdict(int)
        # workers starting for a function on a backbone with adapter slots (this plan's Starts added): their
        # free slots are promised to functions of that namespace waiting for them (`slot_coming`)
        self.slot_starts: list[Worker] = [
            w
            for w in snapshot.workers
            if w.state == "starting" and w.function and self._num_slots(w.backbone) > 1
        ]

    def stop(
        self,
        w: Worker,
        reason: str,
        detail: str = "",
        cause: OffloadCause | None = None,
        victim: str = "",
        room_for: str = "",
    ) -> None:
        self.actions.append(Stop(w.id, reason, w.gpu, detail, cause, victim, room_for))  # type: ignore[arg-type]
        self.gone.add(w.id)
        self.stopped_for[w.id] = room_for
        if w.state == "starting":
            self.starting[w.gpu] -= 1
        # Its memory is not given back to the ledger: the process holds it until it has exited (a start in
        # the same round died of OOM creating its CUDA context on the H100). It is *coming* memory: a
        # function may wait for it (`room_coming`), the account frees it once the worker is gone.
        if _live(w):
            for name in w.functions:
                if w in self.live.get(name, ()):
                    self.live[name].remove(w)

    def _num_slots(self, backbone: str) -> int:
        b = self.backbones.get(backbone)
        return b.adapter_slots if b is not None else 1

    def live_count(self, name: str) -> int:
        return len(self.live.get(name, ()))

    def parked_of(self, name: str) -> list[Worker]:
        """``name``'s parked workers this plan neither stopped nor unparked (nor tried to)."""
        return [
            w
            for w in self.live.get(name, ())
            if w.parked and w.id not in self.unparked and w.id not in self.unpark_tried
        ]

    def serving(self, name: str, excluding: Collection[str] = ()) -> list[Worker]:
        """``name``'s bound, unparked live workers (less ``excluding``): those its queue waits behind."""
        live = self.live.get(name, ())
        return [w for w in live if w.state == "bound" and not w.parked and w.id not in excluding]

    def active_count(self, name: str) -> int:
        """``name``'s live workers that serve or will serve without an unpark."""
        return sum(1 for w in self.live.get(name, ()) if not w.parked or w.id in self.unparked)

    # -- parking (PolicyConfig.park_idle) --------------------------------------------------------------
    def park(self, w: Worker, release: int, detail: str, room_for: str = "") -> None:
        """Park ``w``: its ``release`` bytes are free in this plan at once (the driver applies a Park
        synchronously), it stays its function's live worker, and nothing else this plan touches it."""
        self.actions.append(Park(w.id, w.function or "", w.gpu, release, detail, room_for))
        self.ledger.give(w.gpu, release)
        self.protected.add(w.id)

    def park_idle_workers(self) -> None:
        """Park every bound worker idle ``park_after_s`` or longer (no pressure needed): its memory goes to
        the demand and the warm pool of this round. A function with requests queued keeps its workers."""
        after = self.config.park_after_s
        if not self.config.park_idle or after is None:
            return
        for w in sorted(self.snapshot.workers, key=lambda w: w.id):
            fn = self.functions.get(w.function or "")
            if (
                w.state != "bound"
                or w.parked
                or not w.parkable
                or w.running > 0
                or w.id in self.gone
                or fn is None
                or any(f.queued > 0 for f in served_functions(w, self.functions))
                or w.idle_s < after
            ):
                continue
            release = release_bytes(w, self.config.park_release_fraction)
            if release > 0:
                self.park(w, release, f"idle {w.idle_s:.0f} s >= park_after_s {after:.0f} s")

    def park_for(self, fn: Function, gpus: list[str], need_bytes: int) -> str | None:
        """Park idle workers on the one of ``gpus`` where that loses the least value so that ``need_bytes``
        fit there now; that GPU, or None when parking cannot make room on any (nothing is parked then)."""
        if not self.config.park_idle:
            return None
        guard_s = self.config.thrash_horizon_starts * self.costs.fresh_start_s
        best = None
        for g in gpus:
            short = need_bytes - self.ledger.free[g]
            if short <= 0:
                return g
            cands = park_candidates(
                (w for w in self.on_gpu.get(g, ()) if w.id not in self.gone),
                self.functions,
                self.protected,
                self.config.unpark_s,
                self.config.park_release_fraction,
                guard_s,
                self.config.victim_rate,
            )
            parks = choose_parks(cands, short)
            if parks is None:
                continue
            rank = (sum(c.density * c.release for c in parks), len(parks), g)
            if best is None or rank < best[0]:
                best = (rank, g, parks)
        if best is None:
            return None
        _, g, parks = best
        for c in parks:
            self.park(c.worker, c.release, f"idle bound worker parked: makes room for {fn.name}", fn.name)
        return g

    def try_unpark(self, fn: Function, parked: list[Worker]) -> tuple[Worker, int, bool]:
        """Of ``fn``'s ``parked`` workers the one that fits best (most free on its GPU once its KV is back)
        and the bytes it takes back; unparked (True) where they fit now or after parking idle workers on its
        GPU, else nothing is done (False)."""
        fraction = self.config.park_release_fraction
        w = max(parked, key=lambda w: (self.ledger.free[w.gpu] - release_bytes(w, fraction), w.id))
        need = release_bytes(w, fraction)
        if self.ledger.fits(w.gpu, need) or self.park_for(fn, [w.gpu], need) is not None:
            self.unpark(fn, w, need)
            return w, need, True
        return w, need, False

    def unpark(self, fn: Function, w: Worker, need: int) -> None:
        self.ledger.take(w.gpu, need)
        self.actions.append(Unpark(w.id, fn.name, w.gpu, need))
        self.unparked.add(w.id)
        self.protected.add(w.id)
        self.served.add(fn.name)

    def unpark_path(self, fn: Function, cause: OffloadCause) -> bool:
        """One of ``fn``'s parked workers serves again, or is on its way to (True); False: none is parked,
        or no memory can be had for one (the caller goes on as for a function without one)."""
        parked = self.parked_of(fn.name)
        if not parked:
            return False
        w, need, unparked = self.try_unpark(fn, parked)
        if unparked:
            return True
        self.unpark_tried.add(w.id)  # whatever happens below, not again this round
        if self.room_coming(fn, [w.gpu], need):
            return True
        standby = self.pick_standby(fn, set(self.where.get(fn.backbone, ())))
        if standby is not None:  # a ready standby serves at once and needs no more memory
            self.bind(fn, standby)
            return True
        if self.config.offloading:
            made = self.offload_for(fn, [w.gpu], cause, need)
            if made is not None:
                self.wait_for_room(fn, *made, need_bytes=need)
                return True
        return False

    # -- step 2 ------------------------------------------------------------------------------
    def retire(self) -> None:
        for name in sorted(self.live):
            # a worker with adapter slots is retired by its first function: the ones that joined it leave
            # their slot on their own keep-alive (the worker does that), never stopping the others' process
            workers = [w for w in self.live[name] if w.function == name]
            fn = self.functions.get(name)
            if fn is None:
                for w in sorted(workers, key=lambda w: w.id):
                    self.stop(w, "scale_down", f"function {name} is gone")
                continue
            idle = sorted(
                (w for w in workers if w.state == "bound" and w.running == 0), key=lambda w: (-w.idle_s, w.id)
            )
            parked_keep_alive = self.config.parked_keep_alive_s
            for w in idle:
                n = self.live_count(name)
                # a parked worker's own keep-alive where set (PolicyConfig.parked_keep_alive_s)
                own = w.parked and parked_keep_alive is not None
                keep_alive = parked_keep_alive if own else fn.keep_alive_s
                if n > fn.max_replicas:
                    self.stop(w, "scale_down", f"{n} workers > maxReplicas {fn.max_replicas}")
                elif (
                    fn.queued == 0
                    and fn.batch_backlog == 0
                    and w.idle_s >= keep_alive
                    and n > fn.min_replicas
                ):
                    what = "parked keep-alive" if own else "keepAlive"
                    self.stop(w, "keep_alive", f"idle {w.idle_s:.0f} s >= {what} {keep_alive:.0f} s")
        for w in self.snapshot.workers:
            if is_pool_worker(w) and w.gpu not in self.where.get(w.backbone, ()):
                self.stop(w, "pool_shrink", f"GPU {w.gpu} does not hold backbone {w.backbone}")

    # -- step 3 ------------------------------------------------------------------------------
    def demand(self) -> None:
        # Warm: its next arrival finds a worker: one bound and idle, or bound and keeping up (nothing waits
        # in the function's queue: a busy worker batches the next request). Only a function with no bound
        # worker, or whose workers fall behind (queue growing: a scale-up is coming), may start cold; on
        # the H100 replay counting every busy function as cold kept four 2-GiB-KV standbys (~20 GB) for
        # functions that never needed another worker.
        warm: set[str] = set()
        for n, ws in self.live.items():
            fn = self.functions.get(n)
            bound = [w for w in ws if w.state == "bound"]  # (starting ones serve nothing yet)
            if fn is not None and bound and (fn.queued == 0 or any(w.running == 0 for w in bound)):
                warm.add(n)
        self.warm = warm
        self.cold = cold_demand(
            self.snapshot.functions, warm, refill_s(self.costs, self.config), self.config.cold_prior_rps
        )
        wants = []
        live = self.live
        for fn in self.snapshot.functions:
            n = len(live[fn.name]) if fn.name in live else 0
            active = self.active_count(fn.name)  # parked workers serve only once unparked
            first = 1 if fn.queued > 0 and active == 0 else 0
            floor = fn.min_replicas - n
            need = max(first, floor)
            if (
                need == 0
                and 0 < active < fn.max_replicas
                and (fn.queued / active > self.config.scale_up_queue_per_worker or self.waits_too_long(fn))
            ):
                need = 1
            need = min(need, fn.max_replicas - active)
            if need > 0:
                urgency = 0 if first else (1 if floor > 0 else 2)
                wants.append((urgency, -fn.oldest_wait_s, fn.name, need))
        ready = []
        for urgency, _, name, need in sorted(wants):
            fn = self.functions[name]
            remaining = backoff_remaining_s(fn, self.config.backoff_base_s, self.config.backoff_cap_s)
            if remaining > 0:
                self.actions.append(Wait(name, backoff_reason(fn, remaining), "backoff"))
            else:
                ready.append((fn, need, _CAUSES[urgency]))
        # First every bind to a standby prepared for the function's shape, so that a function
        # earlier in line does not take (and pay a graph capture on) a standby prepared for another.
        rest = []
        for fn, need, cause in ready:
            gpus = set(self.where.get(fn.backbone, ()))
            if cause != "min_replicas":  # its parked workers first (the floor counts them already)
                while need > 0 and self.unpark_path(fn, cause):
                    need -= 1
                need = min(need, fn.max_replicas - self.live_count(fn.name))  # new ones: parked count
            while need > 0:
                # a free adapter slot of a live worker first (no process, no memory), then a standby
                worker = self.pick_slot(fn, gpus) or self.pick_standby(fn, gpus, prepared_only=True)
                if worker is None:
                    break
                self.bind(fn, worker)
                need -= 1
            rest.append((fn, need, cause))
        for fn, need, cause in rest:
            for _ in range(need):
                if not self.acquire(fn, cause):
                    break
        self.batch_demand()

    def waits_too_long(self, fn: Function) -> bool:
        """``scale_up_wait_fraction``: its oldest queued request has waited that share of its TTFT SLO behind
        workers that are all busy (a short queue that is about to miss its deadline)."""
        fraction = self.config.scale_up_wait_fraction
        if fraction is None or fn.queued == 0 or fn.ttft_slo_ms is None:
            return False
        serving = self.serving(fn.name)
        return (
            bool(serving)
            and all(w.running > 0 for w in serving)
            and fn.oldest_wait_s >= fraction * fn.ttft_slo_ms / 1000
        )

    def batch_demand(self) -> None:
        """Offline batch backlog: more workers from ready standbys only, after all online demand."""
        for fn in sorted(self.snapshot.functions, key=lambda f: (-f.batch_backlog, f.name)):
            n = self.live_count(fn.name)
            if fn.batch_backlog == 0 or n == 0:  # n == 0: the runner's cold-start demand is online demand
                continue
            if backoff_remaining_s(fn, self.config.backoff_base_s, self.config.backoff_cap_s) > 0:
                continue
            # the backlog is what the live workers had no room for: one more worker per full wave of it
            want = min(
                fn.max_replicas, n + math.floor(fn.batch_backlog / self.config.batch_backlog_per_worker)
            )
            gpus = set(self.where.get(fn.backbone, ()))
            for _ in range(want - n):
                standby = self.pick_standby(fn, gpus)
                if standby is None:
                    break
                self.bind(fn, standby)

    def acquire(self, fn: Function, cause: OffloadCause = "cold_start") -> bool:
        """One more worker for ``fn``: bind, else start, else offload and start, else Wait."""
        gpus = self.where.get(fn.backbone, [])
        if fn.backbone not in self.backbones:
            self.actions.append(
                Wait(fn.name, f"backbone {fn.backbone} is not known to the controller", "no_backbone")
            )
            return False
        if not gpus:
            self.actions.append(
                Wait(fn.name, f"backbone {fn.backbone} is not loaded on any GPU", "no_backbone")
            )
            return False
        standby = self.pick_slot(fn, set(gpus)) or self.pick_standby(fn, set(gpus))
        if standby is not None:
            self.bind(fn, standby)
            return True
        warming = self.warming_standby(fn, set(gpus))
        if warming is not None:
            # A standby that can take it is coming up: it will be ready sooner than a fresh worker would
            # (which also starts from nothing), and binding it costs no memory beyond what it holds.
            self.protected.add(warming.id)
            self.claimed.add(warming.id)
            # no longer cold: the pool must not start more standbys of its shape for it (with the cold prior
            # and its own arrival it started two more on the README demo's 2-core VM)
            self.served.add(fn.name)
            left = max(0.0, self.costs.fresh_start_s - warming.age_s)
            self.actions.append(
                Wait(
                    fn.name,
                    f"a standby worker for it is warming up (ready in ~{left:.0f} s)",
                    "standby_warming",
                )
            )
            return True
        coming = self.slot_coming(fn, set(gpus))
        if coming is not None:
            # A worker with adapter slots is starting for a function of its namespace: it takes this one into
            # a free slot once it is up (`pick_slot`), as soon as a fresh start of its own would be ready and
            # with no memory of its own (a burst over many cold functions of one tenant starts one process)
            self.slots_taken[coming.id] += 1
            self.protected.add(coming.id)
            self.served.add(fn.name)
            self.actions.append(
                Wait(
                    fn.name,
                    f"joins a worker with adapter slots that is starting for {coming.function}",
                    "standby_warming",
                )
            )
            return True
        need = self.start_bytes(fn)
        fits_now = any(self.start_slot(g) and self.ledger.free[g] >= need for g in gpus)
        if not fits_now and self.room_coming(fn, gpus, need):
            return False
        open_gpus = [g for g in gpus if self.start_slot(g)]
        if not open_gpus:
            if not self.only_a_start_now_meets(fn, gpus):
                self.actions.append(Wait(fn.name, self.no_slot_reason(gpus), "start_slot"))
                return False
            open_gpus = list(gpus)  # over the cap: waiting would make its oldest request miss its deadline
        free = self.ledger.free
        best = max((g for g in open_gpus if free[g] >= need), key=lambda g: free[g], default=None)
        if best is None:
            best = self.park_for(fn, open_gpus, need)  # None unless park_idle
        if best is None and self.config.offloading:
            made = self.offload_for(fn, open_gpus, cause, need)
            if made is not None:
                # Start once the victims have exited, not now: their processes hold the memory until then,
                # and a worker started at once created its CUDA context first and died of OOM (H100, 110
                # functions: 3 starts; the account had room on paper). The memory is the function's from now
                # on (`wait_for_room`), and the next rounds count it as coming for it while they drain.
                self.wait_for_room(fn, *made)
                return False
        if best is None:
            self.actions.append(Wait(fn.name, self.no_room_reason(fn, gpus), "no_room"))
            return False
        self.ledger.take(best, need)
        self.starting[best] += 1
        slots = self._num_slots(fn.backbone)
        self.actions.append(Start(best, fn.backbone, fn.shape, fn.name, need, "demand", slots))
        self.served.add(fn.name)
        # A placeholder so that live counts and later offloading see the new worker.
        new = Worker(
            f"<new:{fn.name}:{len(self.actions)}>", best, fn.backbone, "starting", fn.shape, fn.name, need
        )
        self.live[fn.name].append(new)
        if slots > 1:
            self.slot_starts.append(new)
        return True

    def start_bytes(self, fn: Function) -> int:
        """What a worker started for ``fn`` reserves: ``fn.mem_bytes``, and on a backbone with K adapter
        slots the KV budget and adapter buffers of the K - 1 functions that may join it (a shared worker
        holds what K workers' budgets would, less K - 1 CUDA contexts and backbone mappings)."""
        extra = (self._num_slots(fn.backbone) - 1) * (fn.kv_bytes + fn.lora_bytes)
        return fn.mem_bytes + extra

    def slot_coming(self, fn: Function, gpus: set[str]) -> Worker | None:
        """A worker starting for another function of ``fn``'s namespace on its backbone (with adapter slots),
        on a GPU of ``gpus``, whose slot shape holds ``fn``'s adapter and whose slots are not all promised
        yet (`slots_taken`): ``fn`` waits for it instead of starting a process of its own."""
        slots = self._num_slots(fn.backbone)
        namespace = fn.name.partition("/")[0]
        for w in self.slot_starts:
            if (
                w.id not in self.gone
                and w.backbone == fn.backbone
                and w.gpu in gpus
                and w.function != fn.name
                and (w.function or "").partition("/")[0] == namespace
                and shape_holds(w.shape, fn.shape)
                and self.slots_taken[w.id] < slots - 1
            ):
                return w
        return None

    def coming(self, fn: Function, gpu: str) -> list[Worker]:
        """Workers on ``gpu`` that are exiting (draining, or stopped in this plan) and whose memory ``fn`` may
        count on: those stopped to make room for it first, then those stopped for no one (keep-alive, scale
        down, pool shrink), largest first; none that a Wait of this plan counts already."""
        own, free = [], []
        for w in self.on_gpu.get(gpu, ()):
            if w.id in self.room_used or (w.id not in self.gone and w.state != "draining"):
                continue
            target = self.room_target(w)
            if target == fn.name:
                own.append(w)
            elif not target:
                free.append(w)
        return own + sorted(free, key=lambda w: (-w.mem_bytes, w.id))

    def room_coming(self, fn: Function, gpus: list[str], need_bytes: int | None = None) -> bool:
        """Whether ``fn`` fits on one of ``gpus`` once workers now exiting there are gone (`coming`): then it
        Waits for them (`wait_for_room`) and nothing is offloaded for it. The most of its own room first.
        ``need_bytes``: the memory it needs (None: a worker of it, ``fn.mem_bytes``; an unpark: less)."""
        size_needed = fn.mem_bytes if need_bytes is None else need_bytes
        best = None
        for g in gpus:
            need = size_needed - max(0, self.ledger.free[g])
            counted, size = [], 0
            for w in self.coming(fn, g):
                if size >= need:
                    break
                counted.append(w)
                size += w.mem_bytes
            if counted and size >= need:
                own = sum(w.mem_bytes for w in counted if self.room_target(w) == fn.name)
                rank = (-own, len(counted), g)
                if best is None or rank < best[0]:
                    best = (rank, g, counted)
        if best is None:
            return False
        self.wait_for_room(fn, best[1], best[2], need_bytes=size_needed)
        return True

    def room_target(self, w: Worker) -> str:
        """The function an exiting worker's memory is for ("" none): its Stop's in this plan, else its own."""
        return self.stopped_for.get(w.id, "") if w.id in self.gone else (w.room_for or "")

    def wait_for_room(
        self, fn: Function, gpu: str, exiting: list[Worker], need_bytes: int | None = None
    ) -> None:
        """``fn`` waits for ``exiting`` (workers whose processes are ending) on ``gpu``: their memory and the
        free part it needs beside them are its own in this plan (the free part taken from the ledger, so no
        later demand or the pool uses it; the account counts the exiting ones as used until they are gone).
        """
        size = sum(w.mem_bytes for w in exiting)
        self.room_used.update(w.id for w in exiting)
        need = fn.mem_bytes if need_bytes is None else need_bytes
        self.ledger.take(gpu, max(0, need - size))
        self.served.add(fn.name)
        self.actions.append(Wait(fn.name, self.making_room_reason(gpu, exiting), "making_room"))

    def making_room_reason(self, gpu: str, victims: list[Worker]) -> str:
        size = sum(w.mem_bytes for w in victims)
        return (
            f"making room on GPU {gpu}: {len(victims)} stopped worker(s) ({gib(size)}) are exiting; "
            f"its worker starts once they are gone"
        )

    def start_slot(self, gpu: str) -> bool:
        """Whether one more fresh start may begin on ``gpu`` (`PolicyConfig.max_fresh_starts_per_gpu`)."""
        cap = self.config.max_fresh_starts_per_gpu
        return cap is None or self.starting[gpu] < cap

    def slot_wait_s(self, gpus: list[str]) -> float:
        """About how long until a start slot opens on one of ``gpus``: the soonest a start under way there
        should be done (one that began in this plan takes a whole fresh start)."""
        fresh = self.costs.fresh_start_s
        soonest = fresh
        for g in gpus:
            for w in self.on_gpu.get(g, ()):
                if w.state == "starting" and w.id not in self.gone:
                    soonest = min(soonest, max(0.0, fresh - w.age_s))
        return soonest

    def deadline_left_s(self, fn: Function) -> float | None:
        """Seconds the function's oldest waiting request has left of its TTFT SLO (None: no SLO or nothing
        waits)."""
        if fn.ttft_slo_ms is None or fn.queued == 0:
            return None
        return fn.ttft_slo_ms / 1000.0 - fn.oldest_wait_s

    def only_a_start_now_meets(self, fn: Function, gpus: list[str]) -> bool:
        """Whether a fresh start now keeps ``fn``'s oldest request within its deadline and waiting for a
        start slot (then starting) would not: the one case a start goes over the cap. A request that misses
        either way waits (its start would slow the starts of requests that can still make it)."""
        left = self.deadline_left_s(fn)
        fresh = self.costs.fresh_start_s
        return left is not None and fresh <= left < self.slot_wait_s(gpus) + fresh

    def no_slot_reason(self, gpus: list[str]) -> str:
        cap = self.config.max_fresh_starts_per_gpu
        shown = ", ".join(f"{g}: {self.starting[g]}" for g in sorted(gpus)[:3])
        more = f" and {len(gpus) - 3} more GPUs" if len(gpus) > 3 else ""
        return (
            f"waiting for a start slot or a standby: every GPU holding its backbone has "
            f"max_fresh_starts_per_gpu={cap} fresh starts under way ({shown}{more}); next slot in "
            f"~{self.slot_wait_s(gpus):.1f} s"
        )

    def bind(self, fn: Function, standby: Worker) -> None:
        """Bind ``fn`` to ``standby``, or join it into a free adapter slot of a bound worker (`pick_slot`)."""
        join = standby.state == "bound"
        self.actions.append(
            Bind(
                standby.id, fn.name, standby.gpu, join or standby.shape == fn.shape,
                standby.preloaded == fn.name, join,
            )
        )  # fmt: skip
        if join:
            self.slots_taken[standby.id] += 1
        else:
            self.standbys[fn.backbone].remove(standby)
        self.protected.add(standby.id)
        self.served.add(fn.name)
        self.live[fn.name].append(standby)

    def pick_slot(self, fn: Function, gpus: set[str]) -> Worker | None:
        """A bound worker that can take ``fn`` into a free adapter slot (docs/runtime.md#adapter-slots): on
        ``fn``'s backbone with ``adapter_slots`` above 1 (the opt-in), on a GPU of ``gpus``, serving
        functions of ``fn``'s namespace only (one process is one fault domain: one tenant's functions share
        it), not parked, not stopped in this plan, not serving ``fn`` already, whose slots' shape holds
        ``fn``'s adapter. The one with the fewest requests running first (the batch it joins is the
        smallest), then the most free slots."""
        backbone = self.backbones.get(fn.backbone)
        if backbone is None or backbone.adapter_slots < 2:
            return None
        namespace = fn.name.partition("/")[0]
        best, best_rank = None, None
        for w in self.snapshot.workers:
            free = w.free_slots - self.slots_taken[w.id]
            if (
                w.state != "bound"
                or w.parked
                or free <= 0
                or w.id in self.gone
                or w.backbone != fn.backbone
                or w.gpu not in gpus
                or fn.name in w.functions
                or any(f.partition("/")[0] != namespace for f in w.functions)
                or not shape_holds(w.shape, fn.shape)
            ):
                continue
            rank = (w.running, -free, w.id)
            if best_rank is None or rank < best_rank:
                best, best_rank = w, rank
        return best

    def warming_standby(self, fn: Function, gpus: set[str]) -> Worker | None:
        """A pool worker still starting that could take ``fn`` (its shape, or shape-agnostic, big enough),
        younger than a fresh start takes, and that no other function of this round claimed; the oldest first
        (it is ready soonest)."""
        if not self.config.warm_pool:
            return None
        candidates = [
            w
            for w in self.snapshot.workers
            if w.state == "starting"
            and w.function is None
            and w.backbone == fn.backbone
            and w.gpu in gpus
            and w.id not in self.gone
            and w.id not in self.claimed
            and w.mem_bytes >= fn.mem_bytes
            and w.shape in (fn.shape, None)
            # its age is known and it should be up before a fresh worker would be (an older one may be
            # stuck, e.g. a pod no node can schedule: do not wait on it)
            and 0 < w.age_s < self.costs.fresh_start_s
        ]
        return max(candidates, key=lambda w: (w.shape == fn.shape, w.age_s, w.id), default=None)

    def pick_standby(self, fn: Function, gpus: set[str], prepared_only: bool = False) -> Worker | None:
        if not self.config.warm_pool:  # the ablation: every cold start is a fresh process
            return None
        # A bind that must capture graphs is taken only while it still beats a fresh start.
        mismatch_ok = not prepared_only and self.costs.bind_saving_s(prepared=False) > 0
        best, best_rank = None, None
        for w in self.standbys.get(fn.backbone, ()):
            if w.gpu not in gpus or w.id in self.gone or w.mem_bytes < fn.mem_bytes:
                continue
            fit = 0 if w.shape == fn.shape else (1 if w.shape is None else 2)
            if fit > 0 and not mismatch_ok:
                continue
            # its adapter already loaded first; then one holding no other function's adapter (that one
            # may be the next cold start's fast bind)
            held = 0 if w.preloaded == fn.name else (1 if w.preloaded is None else 2)
            rank = (fit, held, w.mem_bytes, -self.ledger.free[w.gpu], w.id)
            if best_rank is None or rank < best_rank:
                best, best_rank = w, rank
        return best

    def offload_for(
        self, fn: Function, gpus: list[str], cause: OffloadCause, need_bytes: int | None = None
    ) -> tuple[str, list[Worker]] | None:
        """Stop the least valuable workers on the best GPU so that ``fn`` fits there once they have exited;
        that GPU and the workers stopped, or None. ``need_bytes``: what must fit (None: ``fn.mem_bytes``;
        an unpark: its KV)."""
        need = fn.mem_bytes if need_bytes is None else need_bytes
        counts = {name: len(ws) for name, ws in self.live.items()}
        guard_s = self.config.thrash_horizon_starts * self.costs.fresh_start_s
        # A worker whose function is back soon goes only for what the user asked for (a cold start, the
        # min_replicas floor; never for a scale-up: that function is served already), and only when a start
        # now still meets the waiting request's deadline or the request has waited a guard horizon already
        # (a request that misses either way does not trade its lateness for the next cold start; it does not
        # starve either: with fresh starts slowed to ~8 s under load on the simulated replay, waiting on
        # the deadline alone left requests queued for 40 s).
        left = self.deadline_left_s(fn)
        allow_guarded = cause == "min_replicas" or (
            cause == "cold_start"
            and ((left is not None and left >= self.costs.fresh_start_s) or fn.oldest_wait_s >= guard_s)
        )
        best = None
        for g in gpus:
            cands = candidates(
                (w for w in self.on_gpu.get(g, ()) if w.id not in self.gone),
                self.functions,
                counts,
                self.cold,
                self.costs,
                self.protected,
                guard_s,
                allow_guarded,
                self.config.victim_rate,
            )
            exiting = self.coming(fn, g)  # all of it is short of fn's need, else `room_coming` took it
            short = need - max(0, self.ledger.free[g]) - sum(w.mem_bytes for w in exiting)
            victims = choose_victims(cands, short)
            if victims is None:
                continue
            rank = (lost_value(victims), len(victims), g)
            if best is None or rank < best[0]:
                best = (rank, g, victims, exiting)
        if best is None:
            return None
        _, g, victims, exiting = best
        for v in victims:
            w = v.worker
            kind = "standby" if v.tier == 0 else "idle bound worker"
            self.stop(
                w,
                "offload",
                f"{kind} of {w.function or w.shape or 'any shape'} makes room for {fn.name} ({cause})",
                cause,
                "standby" if v.tier == 0 else "idle_bound",
                fn.name,
            )
            if w.state == "standby":
                self.standbys[w.backbone].remove(w)
        return g, exiting + [v.worker for v in victims]

    def no_room_reason(self, fn: Function, gpus: list[str]) -> str:
        shown = sorted(gpus, key=lambda g: (-self.ledger.free[g], g))[:3]
        parts = []
        for g in shown:
            a: MemoryAccount = self.account[g]
            busy = sum(w.mem_bytes for w in self.on_gpu.get(g, ()) if w.id not in self.gone)
            parts.append(
                f"{g}: {gib(max(0, self.ledger.free[g]))} free of {gib(a.capacity_bytes)} "
                f"(backbones {gib(a.backbone_bytes)}, workers {gib(busy)}, other {gib(a.other_bytes)})"
            )
        more = f" and {len(gpus) - len(shown)} more GPUs" if len(gpus) > len(shown) else ""
        return (
            f"no GPU holding backbone {fn.backbone} has room for a {gib(fn.mem_bytes)} worker, even after "
            f"offloading idle workers: " + "; ".join(parts) + more
        )

    # -- step 4 ------------------------------------------------------------------------------
    def warm_pool(self) -> list:
        if not self.config.warm_pool:  # the ablation: no standby workers at all
            for w in self.snapshot.workers:
                if is_pool_worker(w) and w.id not in self.gone and w.id not in self.protected:
                    self.stop(w, "pool_shrink", "the warm pool is switched off")
            return []
        # Functions given a worker this round are no longer cold (offloaded idle workers make their
        # functions colder, but they were the least valuable: not worth a second full pass).
        cold = self.cold.without(self.served)
        pool = [
            w
            for w in self.snapshot.workers
            if is_pool_worker(w) and w.id not in self.gone and w.id not in self.protected
        ]
        cap = self.config.max_fresh_starts_per_gpu
        slots = None if cap is None else {g: max(0, cap - self.starting[g]) for g in self.account}
        claimed: dict[tuple[str, str], int] = defaultdict(int)
        for w in self.snapshot.workers:
            if w.id in self.claimed and w.id not in self.gone:
                claimed[(w.gpu, w.backbone)] += 1
        targets, actions = plan_pool(
            self.snapshot, self.ledger, pool, cold, self.config, self.where, slots, claimed
        )
        self.actions.extend(actions)
        return targets

    # -- step 5 ------------------------------------------------------------------------------
    def preload(self) -> None:
        if not self.config.warm_pool:
            return
        stopped = self.gone | {a.worker_id for a in self.actions if isinstance(a, Stop)}
        ready = [
            w
            for w in self.snapshot.workers
            if w.state == "standby" and w.id not in stopped and w.id not in self.protected
        ]
        _, actions = plan_preload(
            self.snapshot.functions,
            ready,
            self.where,
            self.costs,
            refill_s(self.costs, self.config),
            self.warm | self.served,
        )
        self.actions.extend(actions)

    # -- step 3' -----------------------------------------------------------------------------
    def burst_kv(self) -> None:
        """More KV for the busy workers of a function whose online requests wait in its queue
        (`PolicyConfig.burst_kv_bytes`), out of what online demand left free, keeping room for one more
        standby. A worker holds only what its KV serves, so the queue is what its full workers left; each
        grows by its share of the queue at its present KV per running request (at least half its own KV
        more, so that a growing burst does not resize it every round; never less than one request's
        worth), up to the budget. Not for a function an Unpark or a Bind of this plan serves within a
        moment, nor while a worker of it is idle (it reads the queue at its next poll)."""
        budget = self.config.burst_kv_bytes
        if budget <= 0:
            return
        parking = {a.worker_id for a in self.actions if isinstance(a, Park)}
        served_now = {a.function for a in self.actions if isinstance(a, (Bind, Unpark))}
        for fn in sorted(self.snapshot.functions, key=lambda f: (-f.oldest_wait_s, f.name)):
            if fn.queued == 0 or fn.oldest_wait_s < self.config.burst_kv_min_wait_s or fn.name in served_now:
                continue
            serving = self.serving(fn.name, excluding=parking)  # (a stopped worker has left `live`)
            if not serving or any(w.running == 0 for w in serving):
                continue
            share = math.ceil(fn.queued / len(serving))
            for w in sorted(serving, key=lambda w: w.id):
                if w.kv_bytes <= 0 or w.kv_bytes >= budget or not w.kv_limited:
                    continue  # (its batch slots, not its KV, hold the queue back: more KV would sit idle)
                per_request = math.ceil(w.kv_bytes / w.running)
                want = min(budget, w.kv_bytes + max(share * per_request, w.kv_bytes // 2))
                delta = min(want - w.kv_bytes, self.grant_room(w.gpu)) // MIB * MIB
                if delta >= per_request:
                    queue = f"{fn.queued} queued ({fn.oldest_wait_s:.1f} s)"
                    self.grant(w, fn, delta, f"burst: {queue} behind {len(serving)} busy worker(s)", "burst")

    def slot_kv(self) -> None:
        """A worker with adapter slots holding less KV than the functions it serves would hold alone (a
        standby of a slot backbone, sized for one function, that others joined; joins of this plan counted)
        gets the difference, as far as `grant_room` allows: each function brings its KV budget."""
        joining: dict[str, list[str]] = defaultdict(list)
        for a in self.actions:
            if isinstance(a, Bind) and a.join:
                joining[a.worker_id].append(a.function)
        for w in sorted(self.snapshot.workers, key=lambda w: w.id):
            names = [*w.functions, *joining.get(w.id, ())]
            if len(names) < 2 or w.state != "bound" or w.parked or w.id in self.gone or w.kv_bytes <= 0:
                continue
            if any(isinstance(a, (Park, ResizeKV)) and a.worker_id == w.id for a in self.actions):
                continue
            want = self.set_kv_bytes(names)
            delta = min(want - w.kv_bytes, self.grant_room(w.gpu)) // MIB * MIB
            first = self.functions.get(names[-1])
            if delta >= MIB and first is not None:
                self.grant(w, first, delta, f"{len(names)} functions share its slots", "join")

    def set_kv_bytes(self, names: Iterable[str]) -> int:
        """The KV budgets of these functions together (those the snapshot knows)."""
        return sum(f.kv_bytes for f in (self.functions.get(n) for n in names) if f is not None)

    def grant_room(self, gpu: str) -> int:
        """What a KV grant may take on ``gpu``: its free memory less one more standby's, in whole MiB."""
        return (self.ledger.free[gpu] - self.costs.default_standby_bytes) // MIB * MIB

    def grant(self, w: Worker, fn: Function, delta: int, why: str, cause: ResizeCause) -> None:
        """``delta`` bytes more KV for bound worker ``w``, taken from the account in this plan."""
        self.ledger.take(w.gpu, delta)
        self.protected.add(w.id)
        new = w.kv_bytes + delta
        self.actions.append(
            ResizeKV(w.id, fn.name, w.gpu, new, delta, f"{why}: KV {_mib(w.kv_bytes)} -> {_mib(new)}", cause)
        )

    # -- step 6 ------------------------------------------------------------------------------
    def batch_kv(self) -> None:
        """More KV for the workers of functions with an offline batch backlog, out of what the round left
        free (`PolicyConfig.batch_kv_bytes`: up to that budget, keeping room for one more standby, at least
        half the worker's own KV more)."""
        target = self.config.batch_kv_bytes
        if target <= 0:
            return
        for w in sorted(self.snapshot.workers, key=lambda w: w.id):
            fn = self.functions.get(w.function or "")
            if (
                w.state != "bound" or w.parked or w.id in self.gone or fn is None or w.kv_bytes <= 0
                or any(isinstance(a, (Park, ResizeKV)) and a.worker_id == w.id for a in self.actions)
            ):  # fmt: skip
                continue
            if fn.batch_backlog > 0 and w.kv_bytes < target:
                # up to the budget, as much as leaves room for one more standby (whole MiB); less than half
                # the worker's own KV more is not worth its decode graphs' re-capture
                delta = min(target - w.kv_bytes, self.grant_room(w.gpu))
                if delta >= max(MIB, w.kv_bytes // 2):
                    self.grant(w, fn, delta, f"offline batch backlog of {fn.batch_backlog}", "batch")

    def return_kv_grants(self) -> None:
        """A worker holding granted KV (a batch's or a burst's) gets its function's own budget back once it
        has been idle ``kv_grant_idle_s`` with nothing queued and no batch backlog (whatever granted it)."""
        for w in sorted(self.snapshot.workers, key=lambda w: w.id):
            fn = self.functions.get(w.function or "")
            # a worker with adapter slots keeps the KV of every function it serves (`slot_kv`)
            own = max(fn.kv_bytes, self.set_kv_bytes(w.functions)) if fn is not None else 0
            if (
                fn is None or w.state != "bound" or w.parked or w.id in self.gone or not w.kv_grant
                or w.running > 0
                or any(f.queued > 0 or f.batch_backlog > 0 for f in served_functions(w, self.functions))
                or w.idle_s < self.config.kv_grant_idle_s or not 0 < own < w.kv_bytes
                or any(isinstance(a, (Park, ResizeKV)) and a.worker_id == w.id for a in self.actions)
            ):  # fmt: skip
                continue
            self.actions.append(
                ResizeKV(
                    w.id, fn.name, w.gpu, own, own - w.kv_bytes,
                    f"grant done (idle {w.idle_s:.0f} s): KV {_mib(w.kv_bytes)} -> {_mib(own)}",
                    "return",
                )
            )  # fmt: skip


def decide(snapshot: Snapshot, config: PolicyConfig | None = None) -> Plan:
    """The plan of one round (see the module docstring)."""
    r = _Round(snapshot, config or PolicyConfig())
    r.retire()
    r.park_idle_workers()
    r.demand()
    r.slot_kv()
    r.burst_kv()
    pool = r.warm_pool()
    r.preload()
    r.batch_kv()
    r.return_kv_grants()
    account = {
        g: MemoryAccount(
            a.gpu,
            a.total_bytes,
            a.capacity_bytes,
            a.backbone_bytes,
            a.other_bytes,
            a.worker_bytes,
            r.ledger.free[g],
            a.driver_guard_bytes,
        )
        for g, a in r.account.items()
    }
    return Plan(r.actions, pool, account)


def fast_binds(
    snapshot: Snapshot, functions: Iterable[str], config: PolicyConfig | None = None
) -> list[Bind]:
    """Binds for ``functions`` (demand just recorded for them) from ``snapshot`` alone: step 3a of `decide`
    for each that has no live worker, is known, and is not backing off after failed starts. No starts, no
    offloads, no waits: the full round that follows decides those (and sees these binds as pending)."""
    r = _Round(snapshot, config or PolicyConfig())
    for name in sorted(set(functions)):
        fn = r.functions.get(name)
        if fn is None or r.live_count(name) > 0:
            continue
        if backoff_remaining_s(fn, r.config.backoff_base_s, r.config.backoff_cap_s) > 0:
            continue
        gpus = set(r.where.get(fn.backbone, ()))
        standby = r.pick_slot(fn, gpus) or r.pick_standby(fn, gpus)
        if standby is not None:
            r.bind(fn, standby)
    return [a for a in r.actions if isinstance(a, Bind)]


def fast_unparks(
    snapshot: Snapshot, functions: Iterable[str], config: PolicyConfig | None = None
) -> list[Park | Unpark]:
    """Unparks for ``functions`` (demand just arrived for them) from ``snapshot`` alone, as `fast_binds`
    binds: for each whose live workers are all parked, one Unpark where its KV fits now or once idle workers
    on its GPU are parked (those Parks first; none without ``park_idle``, but parked workers left from
    when it was on are still unparked). No stops or waits (the full round does those)."""
    r = _Round(snapshot, config or PolicyConfig())
    for name in sorted(set(functions)):
        fn = r.functions.get(name)
        parked = r.parked_of(name)
        if fn is None or not parked or r.active_count(name) > 0:
            continue
        r.try_unpark(fn, parked)
    return [a for a in r.actions if isinstance(a, (Park, Unpark))]


def _mib(size: int) -> str:
    return f"{size / MIB:.0f} MiB"
