"""SLO-aware batching in a worker: latency profile, fill or expire, and the GPU's prefill token budget.

The serving loop (`worker.py`) calls `Batching` at four points; the decisions are `lorafn.runtime.slo`'s
(pure), the Redis operations `lorafn.store.admission`'s:

- `load()` at start (one round trip): the function's SLO and the stored profile of its backbone, GPU
  model and adapter shape (the prior until this worker has measured its own steps);
- `arrived()` when entries were read: an idle worker may hold its first prefill for companions (`hold_left_ms`
  says how much longer; the loop waits for more entries that long, never past `SLO − T(N)`);
- `allow_prefill()` before an engine step: with prefills pending it asks for a share of the GPU's
  prefill budget, the prompt tokens its step will prefill, bidding with the TTFT deadline of the prompt
  its step serves first (`bid_deadline` "plan": the engine's deadline plan's first prompt that can still
  make it, else the oldest waiting online request; one round trip; a worker alone on its GPU is
  granted at once); granted, `prefill_cap` is the share's tokens and the loop's step prefills no more
  than that (`Engine.step(max_prefill_tokens=...)`: the rest of a prompt is chunked into the next granted
  steps); refused, the step runs the decodes only, or, with none, the loop blocks until a share
  is handed to it (`wait_for_slot`, woken by the releasing worker's script). No prefill pending (a
  decode step): nothing is asked. A worker whose granted step could prefill nothing (its KV cache or
  batch is full: the waiting requests wait for running ones to finish) asks no more until one of its
  running requests ends (or `blocked_recheck_ms` passes): before, such a worker kept winning the share
  with its oldest deadline and held it across its decode steps while every other function's prefill
  waited (the cause of the H100 collapse, docs/benchmarks.md). Switched off (`gpu_admission=False`),
  without a device id, or with an engine that cannot hold its prefills back, it always answers True;
- `after_step()` after the step (its wall time into the profile; the blocked check) and `pipeline_ops()`
  on the round trip the loop makes right after every step: the release of the share (with the step's
  end time, so the record shows how late it came), the active mark (M), the profile's publication.

Decode gating (`decode_gating=True`, on top of admission; docs/scheduler.md#decode-gating): the ask
carries the function's urgent threshold (`slo.urgent_threshold_ms`) and the script marks a grant with
a smaller margin urgent. While this worker knows other workers to be active on its GPU (M >= 2, from the
active mark's and the ask's answers), the round trip after each step also reads the GPU's urgent
grants (one HGETALL in that pipeline, no round trip of its own; alone on its GPU it reads nothing).
Seeing another worker's urgent grant, `pause_decodes()` before the next step with decodes waits for it
to end (`gate_wait`: one round trip, woken by the urgent worker's release), at most the TPOT slack
(`slo.decode_delay_bound_ms`; the function's `tpotMs`, else `gate_tpot_ms`) and at most once per step
(`slo.DecodeGate`). A worker that runs a granted prefill itself is never paused. The gated steps and
their wait go into the GPU's gating counters on the next round trip.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lorafn.runtime import slo
from lorafn.store import Keys, Op, Store
from lorafn.store import admission as store_admission

log = logging.getLogger("lorafn.worker")

BID_DEADLINES = ("plan", "oldest")


@dataclass
class BatchingConfig:
    """`gpu`: the controller's id of the worker's device (the slot is per device; "" = no admission).
    `ttft_ms`/`tpot_ms`: the function's SLO (None: read from its registration at `load`)."""

    gpu: str = ""
    gpu_admission: bool = False  # opt-in (WorkerSettings.gpu_admission)
    batch_hold: bool = True
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    backbone: str = ""
    gpu_model: str = "cpu"
    shape: str = ""
    prefill_tokens: int = 4096  # the device's prefill budget: prompt tokens prefilled at once (2 full steps)
    lease_ms: float = 2000.0  # the share of a worker that died frees itself after this
    poll_ms: float = 5.0  # a refused worker with no decode to run asks again after at most 20x this
    active_ttl_ms: float = 2000.0  # a worker that stopped marking itself active leaves M after this
    publish_every: int = 32  # store the fit every this many measured steps of a kind
    warmup_steps: int = 2  # first steps of each kind are not measured (kernels load, caches fill)
    blocked_recheck_ms: float = 2000.0  # a worker that could not prefill asks again after this at the latest
    decode_gating: bool = False  # opt-in (WorkerSettings.decode_gating); needs gpu_admission
    gate_tpot_ms: float = 200.0  # the TPOT SLO that bounds a paused decode when the spec has no tpotMs
    urgent_fraction: float = 0.5  # a grant is urgent when its margin is below this share of the TTFT SLO
    gate_min_pause_ms: float = 5.0  # a TPOT slack smaller than this is not worth a pause's round trip
    gate_max_pause_ms: float = 2000.0  # a pause blocks the loop's Redis connection: never near its timeout
    # the deadline the ask bids with: "plan" = of the first prompt the engine's deadline plan serves on time
    # (`Engine.next_prefill_deadline`; the oldest waiting request's when none is on time or the order is off),
    # "oldest" = the oldest waiting online request's (before issue 13's change; kept for the ablation)
    bid_deadline: str = "plan"

    def __post_init__(self) -> None:
        if (
            isinstance(self.prefill_tokens, bool)
            or not isinstance(self.prefill_tokens, int)
            or (self.prefill_tokens < 1)
        ):
            raise ValueError(f"prefill_tokens must be an integer >= 1, got {self.prefill_tokens!r}")
        if not 0 <= self.urgent_fraction <= 1:
            raise ValueError(f"urgent_fraction must be in [0, 1], got {self.urgent_fraction!r}")
        if self.bid_deadline not in BID_DEADLINES:
            raise ValueError(f"bid_deadline must be one of {BID_DEADLINES}, got {self.bid_deadline!r}")
        if not self.gate_min_pause_ms >= 0:
            raise ValueError(f"gate_min_pause_ms must be >= 0, got {self.gate_min_pause_ms!r}")
        names = (
            "lease_ms",
            "poll_ms",
            "active_ttl_ms",
            "blocked_recheck_ms",
            "gate_tpot_ms",
            "gate_max_pause_ms",
        )
        for name in names:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")


def bid_deadline_ms(rule: str, oldest_ms: float, ttft_ms: float, planned_s: float | None) -> float:
    """The deadline (unix ms) a worker bids with for its GPU's prefill budget. `oldest_ms`: the enqueue time
    of its oldest waiting online request; `planned_s`: the engine's `next_prefill_deadline` (unix seconds),
    the deadline of the first prompt its deadline plan serves on time, None when none is on time or the
    order is off. "plan": that one when known (the step serves the prompts that can still make it first,
    earliest deadline first, and the late ones behind: a late oldest request, which no grant saves, must
    not win the GPU over another worker's prompt that can still make it), else the oldest's deadline;
    "oldest": the oldest's deadline always (the rule before issue 13). Pure."""
    if rule not in BID_DEADLINES:
        raise ValueError(f"bid deadline rule must be one of {BID_DEADLINES}, got {rule!r}")
    if rule == "plan" and planned_s is not None:
        return planned_s * 1000
    return oldest_ms + ttft_ms


def gpu_model_name(device: str) -> str:
    """The profile's GPU model: `cpu`, or the CUDA device's name as a key token (`NVIDIA_H100_80GB_HBM3`)."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    index = int(device.partition(":")[2] or 0)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", torch.cuda.get_device_name(index)).strip("_") or "cuda"


@dataclass(frozen=True)
class GatedStep:
    """One decode step that waited for another worker's urgent prefill: the bound it was allowed (ms),
    how long it waited (ms, the round trip included) and whether the urgent step's end woke it (False:
    it ran to the bound)."""

    bound_ms: float
    waited_ms: float
    woken: bool


class Batching:
    """One worker's SLO-aware batching state (see the module doc)."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        worker_id: str,
        function: str,
        config: BatchingConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.keys, self.worker_id, self.function = store, keys, worker_id, function
        self.config, self.clock = dataclasses.replace(config), clock  # load() fills in the SLO: a copy
        self.profiles = {kind: slo.LatencyProfile() for kind in slo.KINDS}
        self.arrivals = slo.ArrivalRate()
        self._seen = dict.fromkeys(slo.KINDS, 0)
        self._publish: set[str] = set()
        self._hold_until: float | None = None
        self._hold_target = 1
        self._holds_slot = False
        self._pending_after = 0  # prefills still pending after the last step
        self._held_step: tuple[int, int] | None = None  # what the step that held the share ran
        self._step_end_ms = 0.0  # unix ms the step that held the share ended (the release record)
        self._blocked: frozenset[str] | None = None  # running requests when a granted step prefilled nothing
        self._blocked_at = 0.0
        self._active_at: float | None = None  # when this worker last marked itself active
        self._prefill_cap: int | None = None  # the tokens of the share granted for the next step
        self._was_active = False
        self.granted = self.refused = 0  # slot answers (tests and logs read them)
        self.gate = slo.DecodeGate(worker_id, config.gate_min_pause_ms)
        self._others_active: bool | None = None  # another worker active on the GPU (None: not known yet)
        self._urgent = False  # this worker's share is an urgent grant
        self._gated_unsent = (0, 0.0, 0)  # gated steps, their wait (ms), timeouts: not yet counted in Redis
        self.gated_log: deque[GatedStep] = deque(maxlen=1000)  # the recent gated steps (tests read them)
        self.urgent_reads = 0  # round trips that carried the urgent-grant read (tests read it)

    @property
    def admission_on(self) -> bool:
        return self.config.gpu_admission and bool(self.config.gpu)

    @property
    def gating_on(self) -> bool:
        return self.admission_on and self.config.decode_gating

    # -- start ----------------------------------------------------------------------------------
    def load(self, record: Any = None) -> None:
        """The function's SLO (from `record`, its registration, unless configured) and the stored profile."""
        cfg = self.config
        if (cfg.ttft_ms is None or not cfg.backbone) and record is not None and record.spec:
            from lorafn.api import LoRAFunctionSpec

            spec = LoRAFunctionSpec.model_validate(record.spec)
            cfg.ttft_ms = cfg.ttft_ms or float(spec.slo.ttft_ms)
            cfg.tpot_ms = cfg.tpot_ms or (float(spec.slo.tpot_ms) if spec.slo.tpot_ms else None)
            cfg.backbone = cfg.backbone or spec.backbone
        if not self._profile_key():
            return
        stored = self.store.run(
            store_admission.get_profile(self.keys, cfg.backbone, cfg.gpu_model, cfg.shape or "none")
        )
        for kind, fields in stored.items():
            if kind in self.profiles:
                self.profiles[kind].prior = slo.Fit.from_fields(fields)

    def _profile_key(self) -> bool:
        return bool(self.config.backbone and self.config.gpu_model)

    # -- the profile ----------------------------------------------------------------------------
    def fit(self, kind: str) -> slo.Fit | None:
        return self.profiles[kind].fit()

    def max_running(self, limit: int) -> int:
        """The batch the decode SLO allows (`tpotMs`), within `limit`; `limit` without a TPOT or a profile."""
        fit = self.fit(slo.DECODE)
        if self.config.tpot_ms is None or fit is None:
            return limit
        return fit.max_batch(self.config.tpot_ms, limit)

    def observe(self, step: tuple[int, int], ms: float) -> None:
        """One engine step that ran `step` = (prefill, decode) sequences in `ms`."""
        num_prefill, num_decode = step
        kind, b = (slo.PREFILL, num_prefill) if num_prefill else (slo.DECODE, num_decode)
        if b < 1:
            return
        self._seen[kind] += 1
        if self._seen[kind] <= self.config.warmup_steps:
            return
        profile = self.profiles[kind]
        profile.observe(b, ms)
        if profile.samples % self.config.publish_every == 0:
            self._publish.add(kind)

    # -- fill or expire -------------------------------------------------------------------------
    def arrived(self, arrivals_ms: list[float], idle_before: bool, limit: int) -> None:
        """Entries arrived (their enqueue times, unix ms). A worker idle before them may hold."""
        if not arrivals_ms:
            return
        now_ms = time.time() * 1000
        self.arrivals.arrived(now_ms, len(arrivals_ms))
        if not (idle_before and self.config.batch_hold and self.config.ttft_ms):
            return
        fit = self.fit(slo.PREFILL)
        if fit is None:
            return
        target = fit.max_batch(self.config.ttft_ms, limit)
        waited = max(0.0, now_ms - min(arrivals_ms))
        hold = slo.hold_ms(fit, self.config.ttft_ms, target, waited, self.arrivals.interval_ms)
        if hold > 0 and len(arrivals_ms) < target:
            self._hold_until, self._hold_target = self.clock() + hold / 1000, target

    def hold_left_ms(self, num_running: int) -> float:
        """How much longer the first prefill waits for companions (0: go)."""
        if self._hold_until is None:
            return 0.0
        left = (self._hold_until - self.clock()) * 1000
        if left <= 0 or num_running >= self._hold_target:
            self._hold_until = None
            return 0.0
        return left

    # -- the GPU's prefill budget ---------------------------------------------------------------
    def gated(self, engine: Any) -> bool:
        return self.admission_on and hasattr(engine, "num_pending_prefills")

    @property
    def prefill_cap(self) -> int | None:
        """The most prompt tokens the next step may prefill: the tokens of the share the last
        `allow_prefill` was granted (the budget counted those, not what arrived since). None: no cap
        (admission off, no prefill pending, or an engine that cannot cap its prefill chunks)."""
        return self._prefill_cap

    def allow_prefill(self, engine: Any, waiting: Mapping[str, float], running: Collection[str] = ()) -> bool:
        """True: run a full step (the share is ours, or no prefill is pending, or admission is off).
        False: run the decodes only, or — with none — `wait_for_slot` and call again.

        `waiting`: the requests without a first token (request id -> enqueue time, unix ms); `running`:
        every request of the worker."""
        self._prefill_cap = None
        if not self.gated(engine):
            return True
        pending = engine.num_pending_prefills
        if pending == 0:
            self._blocked = None
            return True
        cfg = self.config
        asking_for: Collection[str] | None = None  # every pending prefill (recomputes too)
        if self._blocked is not None:
            decoding = len(waiting) < len(running)
            recheck = (self.clock() - self._blocked_at) * 1000 >= cfg.blocked_recheck_ms
            if decoding and self._blocked <= frozenset(running) and not recheck:
                return False  # nothing freed the cache since: a grant would prefill nothing again
            self._blocked = None
            if waiting:  # what one ended request's cache most likely lets start: the oldest waiting one
                asking_for = [min(waiting, key=waiting.__getitem__)]
        fit = self.fit(slo.PREFILL)
        t_ms = fit.latency_ms(max(1, pending)) if fit else 0.0
        # offline batch requests (priority 1) have no deadline (docs/batch.md): only online ones set it
        priority = getattr(engine, "priority_of", None)
        online = [t for r, t in waiting.items() if not callable(priority) or not priority(r)]
        oldest = min(online) if online else time.time() * 1000
        planned = getattr(engine, "next_prefill_deadline", None)
        planned_s = planned() if cfg.bid_deadline == "plan" and callable(planned) else None
        deadline_ms = bid_deadline_ms(cfg.bid_deadline, oldest, cfg.ttft_ms or 1000.0, planned_s)
        if getattr(engine, "num_pending_online_prefills", pending) == 0:
            deadline_ms = math.inf  # never urgent, behind every online waiter
        decode = self.fit(slo.DECODE)
        step_ms = decode.latency_ms(1) if decode else 0.0
        ttft = cfg.ttft_ms or 1000.0
        urgent_ms = slo.urgent_threshold_ms(ttft, t_ms, cfg.urgent_fraction) if self.gating_on else 0.0
        answer = self.store.run(
            store_admission.ask(
                self.keys, cfg.gpu, self.worker_id, self.function,
                deadline_ms=deadline_ms, t_ms=t_ms, lease_ms=max(cfg.lease_ms, 4 * t_ms),
                waiter_ttl_ms=max(250.0, 4 * step_ms, 8 * cfg.poll_ms), active_ttl_ms=cfg.active_ttl_ms,
                budget=cfg.prefill_tokens, tokens=self.prefill_tokens(engine, waiting, asking_for),
                urgent_ms=urgent_ms,
            )
        )  # fmt: skip
        self._holds_slot = answer.granted  # a share kept from the last step was given up by this ask
        self._urgent = answer.granted and answer.urgent
        self._saw_active(answer.active)
        if answer.granted:
            self.granted += 1
            if callable(getattr(engine, "pending_prefill_tokens", None)) and answer.tokens > 0:
                self._prefill_cap = answer.tokens
            return True
        self.refused += 1
        return False

    def prefill_tokens(
        self, engine: Any, waiting: Collection[str], only: Collection[str] | None = None
    ) -> int:
        """The prompt tokens the next step prefills, at most, within the engine's step budget: what the
        engine's pending prefills (of `only`, when given) have left to compute, recomputes of preempted
        requests included; an engine that does not tell that: the prompts of `waiting` (or `only`), and
        one that tells neither asks for the whole budget (one at a time)."""
        cfg = self.config
        step_budget = getattr(getattr(engine, "config", None), "max_num_batched_tokens", None)
        pending = getattr(engine, "pending_prefill_tokens", None)
        get_output = getattr(engine, "get_output", None)
        if callable(pending):
            total = int(pending(only))
        elif get_output is None:
            return cfg.prefill_tokens
        else:
            total = 0
            for rid in waiting if only is None else only:
                out = get_output(rid)
                total += len(out.prompt_token_ids) if out is not None else 0
        if isinstance(step_budget, int) and step_budget > 0:
            total = min(total, step_budget)
        return max(1, total)

    def after_step(
        self,
        step: tuple[int, int] | None,
        ms: float,
        running: Collection[str],
        pending: int = 0,
        timed: tuple[int, int] | Literal["step"] | None = "step",
    ) -> None:
        """One engine step ran `step` = (prefill, decode) sequences in `ms`; `pending`: the prefills
        still pending after it. A step that held the share and prefilled nothing means the waiting
        requests cannot start until a running one ends. `timed`: the step whose time `ms` is, for the
        profile: with overlapped engine steps the call that queues a step waits for the one before it
        (`Engine.last_read_step`; None: it waited for none, nothing to learn); "step": `step` itself."""
        self.gate.stepped()
        timed_step = step if timed == "step" else timed
        if timed_step is not None:
            self.observe(timed_step, ms)
        self._pending_after = pending
        if self._holds_slot:
            self._held_step = step
            self._step_end_ms = time.time() * 1000
            if step is not None and step[0] == 0 and running:
                self._blocked, self._blocked_at = frozenset(running), self.clock()

    def wait_for_slot(self) -> None:
        """Refused with nothing to decode: block until a share is handed to this worker (or `poll_ms`
        x 20 passes: a lease that ran out hands nothing on)."""
        self.store.run(
            store_admission.wait_for_slot(
                self.keys, self.config.gpu, self.worker_id, self.config.poll_ms / 50
            )
        )

    # -- decode gating --------------------------------------------------------------------------
    def _saw_active(self, active: int) -> int:
        self._others_active = active >= 2  # M counts this worker's own batch
        return active

    def pause_decodes(self, decoding: Callable[[], int]) -> None:
        """Before a step: while another worker of the GPU holds an urgent grant (seen on the last round
        trip), wait for its step to end, at most this worker's TPOT slack (module doc). `decoding`: how
        many running requests decode in the step (called only when a pause is possible)."""
        if not (self.gating_on and self.gate.urgent_elsewhere):
            return
        fit = self.fit(slo.DECODE)
        num = decoding() if fit is not None else 0
        if fit is None or num <= 0:  # no profile yet: no bound to keep, so no pause
            return
        cfg = self.config
        slack = slo.decode_delay_bound_ms(cfg.tpot_ms or cfg.gate_tpot_ms, fit.latency_ms(num))
        bound = min(slack, cfg.gate_max_pause_ms)
        pause = self.gate.pause_ms(num, self._holds_slot, bound)
        if pause <= 0:
            return
        started = time.perf_counter()
        answer = self.store.run(store_admission.gate_wait(self.keys, cfg.gpu, self.worker_id, pause / 1000))
        waited = (time.perf_counter() - started) * 1000
        timed_out = answer.gated and not answer.woken
        self.gate.paused(waited, answer.gated, timed_out)
        if answer.gated:
            steps, ms, timeouts = self._gated_unsent
            self._gated_unsent = (steps + 1, ms + waited, timeouts + int(timed_out))
            self.gated_log.append(GatedStep(bound, waited, answer.woken))

    def pipeline_ops(self, busy: bool) -> list[Op[Any]]:
        """What rides on the loop's round trip: the share's release, the active mark, the profile. The
        release goes first in the pipeline the loop sends right after every step."""
        ops: list[Op[Any]] = []
        cfg = self.config
        if self.admission_on:
            keep = self._held_step is not None and self._pending_after > 0 and self._blocked is None
            if self._holds_slot and keep:
                # more to prefill: the next step's ask gives the share up and competes afresh in one
                # atomic call. A release here would hand it to a looser waiter in the round trip before
                # that ask, and a tighter function then waited a whole long step of the looser one.
                self._held_step = None
                if self._urgent:  # its urgent step ran: the paused workers go on (the ask may re-mark)
                    ops.append(store_admission.urgent_end(self.keys, cfg.gpu, self.worker_id))
                    self._urgent = False
            elif self._holds_slot:
                prefilled = self._held_step[0] if self._held_step is not None else -1
                ops.append(
                    store_admission.release(
                        self.keys, cfg.gpu, self.worker_id, cfg.active_ttl_ms, cfg.prefill_tokens,
                        prefilled=prefilled, step_end_ms=self._step_end_ms,
                    )
                )  # fmt: skip
                self._holds_slot, self._held_step, self._step_end_ms = False, None, 0.0
                self._urgent = False  # the release ended its urgent mark too
            now = self.clock()
            if busy and (self._active_at is None or now - self._active_at > cfg.active_ttl_ms / 3000):
                mark = store_admission.mark_active(self.keys, cfg.gpu, self.worker_id, cfg.active_ttl_ms)
                ops.append(mark.map(self._saw_active))
                self._active_at, self._was_active = now, True
            elif not busy and self._was_active:
                ops.append(
                    store_admission.mark_idle(
                        self.keys, cfg.gpu, self.worker_id, cfg.active_ttl_ms, cfg.prefill_tokens
                    )
                )
                self._active_at, self._was_active = None, False
        if self.gating_on:
            self.gate.saw(())  # what this round trip reads replaces what the last one read
            if busy and self._others_active and not self._urgent:  # not known yet: the mark tells
                ops.append(store_admission.urgent_grants(self.keys, cfg.gpu).map(self.gate.saw))
                self.urgent_reads += 1
            steps, ms, timeouts = self._gated_unsent
            if steps:
                ops.append(store_admission.add_gated(self.keys, cfg.gpu, self.function, steps, ms, timeouts))
                self._gated_unsent = (0, 0.0, 0)
        if self._publish and self._profile_key():
            for kind in sorted(self._publish):
                fit = self.fit(kind)
                if fit is not None:
                    ops.append(
                        store_admission.put_profile(
                            self.keys, cfg.backbone, cfg.gpu_model, cfg.shape or "none", kind, fit.to_fields()
                        )
                    )
                    log.info("worker %s: %s profile T0 %.2f ms, alpha %.2f ms", self.worker_id, kind,
                             fit.t0_ms, fit.alpha_ms)  # fmt: skip
            self._publish.clear()
        return ops
