"""The Redis side of SLO-aware batching: one GPU's prefill token budget and the latency profiles.

The budget (`lua/gpu_admission.lua`, one atomic script): a worker that wants to run a prefill step `ask`s
for the prompt tokens that step prefills, with its oldest waiting request's deadline and the expected
step time `T(b)`; prefills run at once while their tokens fit in the GPU's budget, waiters are served by
smallest deadline margin and the first that does not fit stops the line (`lorafn.runtime.slo.admit` is
the reference). The holder `release`s its share right after its step; a lease ends the hold of a worker
that died. Freed tokens are handed straight to the best waiters, which a blocked waiter learns from its
wake list (`wait_for_slot`) without polling. Workers with a running batch mark themselves `active` (M in
the margin) and leave with `idle`. Decode steps never ask. Every grant and every release is appended to
a capped stream (`admissions`): the grant with the runner-up's margin and how long it waited, the
release with how long the share was held, whether the step prefilled anything and how late after the
step's end the release came (`grants`, `releases`: what tests and `bench/admission.py` read).

Decode gating (docs/scheduler.md#decode-gating): an `ask` with an urgent threshold is granted *urgent*
when its margin is below it (`lorafn.runtime.slo.is_urgent`); the script lists it in the GPU's urgent
hash until the share is released (`urgent_end` when the worker keeps it for its next ask). Other
workers read that hash (`urgent_grants`) on the round trip they make after every step, and only while
another worker of the GPU is active; seeing another's urgent grant they `gate_wait`: one round trip
that joins the paused set and blocks until the last urgent grant ends or their own bound passes. The
workers count their gated steps and the time they waited in the GPU's gating counters (`add_gated`,
read by `gating_counters`).

Profiles: a hash per (backbone, GPU model, adapter shape) with the fit of each step kind, written by
the workers that measured it and read by a new worker as its prior.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lorafn.store.client import Op, eval_script
from lorafn.store.keys import Keys, check_id


@dataclass(frozen=True)
class SlotAnswer:
    """`granted`: the asker holds its share of the budget. `margin_ms`: its own deadline margin as the
    script saw it, `active`: M. Granted: `tokens` is what the share holds, the most the step may prefill
    (fewer than asked when a share was handed on while the worker waited with a smaller ask). Refused:
    `other` is a holder or the waiter first in line; `retry_ms` a hint (when the soonest lease ends)."""

    granted: bool
    margin_ms: float
    active: int
    other: str = ""
    waiters: int = 0
    retry_ms: int = 0
    tokens: int = 0
    urgent: bool = False  # granted urgent: other workers' decodes make room for its step


@dataclass(frozen=True)
class Grant:
    """One recorded grant: the grantee's margin, the next one in line, its tokens and the budget then held
    (its own included), how long it had waited since it first asked."""

    entry_id: str
    worker: str
    function: str
    margin_ms: float
    active: int
    waiters: int
    runner_up_ms: float | None = None  # the next margin in line (None: alone)
    tokens: int = 0
    used: int = 0
    waited_ms: float = 0.0
    urgent: bool = False


@dataclass(frozen=True)
class GateWait:
    """One paused step: `gated` (another worker's urgent grant was live when it began; False: it went on
    at once), `woken` (the last urgent grant ended; False with `gated`: it ran to its bound)."""

    gated: bool
    woken: bool


@dataclass(frozen=True)
class Release:
    """One recorded release: how long the share was held, the sequences the step prefilled (-1: unknown;
    0: the step could prefill nothing, e.g. its KV cache was full), and how long after the step's end the
    release reached Redis (None: unknown)."""

    entry_id: str
    worker: str
    held_ms: float
    prefilled: int
    late_ms: float | None


def _keys(keys: Keys, gpu: str) -> list[str]:
    return [
        keys.gpu_slot(gpu), keys.gpu_waiting(gpu), keys.gpu_active(gpu), keys.gpu_admissions(gpu),
        keys.gpu_wake(gpu), keys.gpu_urgent(gpu), keys.gpu_paused(gpu), keys.gpu_gate_wake(gpu),
        keys.gpu_gating(gpu),
    ]  # fmt: skip


def _ms(value: float, what: str) -> int:
    if not value >= 0:
        raise ValueError(f"{what} must be >= 0 ms, got {value!r}")
    return int(value)


def _tokens(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def ask(
    keys: Keys,
    gpu: str,
    worker: str,
    function: str,
    *,
    deadline_ms: float,
    t_ms: float,
    lease_ms: float,
    waiter_ttl_ms: float,
    active_ttl_ms: float,
    budget: int = 1,
    tokens: int = 1,
    urgent_ms: float = 0.0,
) -> Op[SlotAnswer]:
    """Ask for `tokens` of the GPU's prefill `budget` for the step this worker wants to run (module doc).
    The defaults (1 of 1) make the budget one slot: a mutex. `deadline_ms` +inf: no deadline (only offline
    batch requests to prefill): the margin is +inf, never urgent, behind every waiter with a deadline.
    `urgent_ms`: the margin below which the grant is urgent (`slo.urgent_threshold_ms`; 0: never)."""
    check_id(worker, "worker id")
    if math.isnan(deadline_ms) or deadline_ms == -math.inf:
        raise ValueError(f"deadline_ms must be a time (unix ms) or +inf, got {deadline_ms!r}")
    deadline = "none" if deadline_ms == math.inf else f"{deadline_ms:.1f}"
    args = [
        "ask", worker, function, deadline, f"{max(0.0, t_ms):.3f}", _ms(lease_ms, "lease_ms"),
        max(1, _ms(waiter_ttl_ms, "waiter_ttl_ms")), max(1, _ms(active_ttl_ms, "active_ttl_ms")),
        _tokens(budget, "budget"), _tokens(tokens, "tokens"), _ms(urgent_ms, "urgent_ms"),
    ]  # fmt: skip
    names = _keys(keys, gpu)

    def parse(r: list[Any]) -> SlotAnswer:
        code, margin, active, *rest = r[0]
        if int(code) == 1:
            return SlotAnswer(
                True, float(margin), int(active), waiters=int(rest[0]), tokens=int(rest[1]),
                urgent=bool(int(rest[2])),
            )  # fmt: skip
        return SlotAnswer(False, float(margin), int(active), other=str(rest[0]), retry_ms=int(rest[1]))

    return Op(lambda pipe: eval_script(pipe, "gpu_admission", names, args), parse)


def release(
    keys: Keys,
    gpu: str,
    worker: str,
    active_ttl_ms: float,
    budget: int = 1,
    prefilled: int = -1,
    step_end_ms: float = 0.0,
) -> Op[bool]:
    """Free this worker's share, handing it to the best waiters; True when it held one. `prefilled` and
    `step_end_ms` (unix ms) go into the record only."""
    names = _keys(keys, gpu)
    args = [
        "release", worker, max(1, _ms(active_ttl_ms, "active_ttl_ms")), _tokens(budget, "budget"),
        int(prefilled), int(max(0.0, step_end_ms)),
    ]  # fmt: skip
    return Op(lambda pipe: eval_script(pipe, "gpu_admission", names, args), lambda r: bool(r[0]))


def mark_active(keys: Keys, gpu: str, worker: str, ttl_ms: float) -> Op[int]:
    """This worker has a running batch on the GPU (for `ttl_ms`); returns M, the active batches."""
    names = _keys(keys, gpu)
    args = ["active", worker, max(1, _ms(ttl_ms, "ttl_ms"))]
    return Op(lambda pipe: eval_script(pipe, "gpu_admission", names, args), lambda r: int(r[0]))


def mark_idle(keys: Keys, gpu: str, worker: str, active_ttl_ms: float, budget: int = 1) -> Op[None]:
    """This worker's batch is empty: out of the active set and the waiters; its share, if held, handed on."""
    names = _keys(keys, gpu)
    args = ["idle", worker, max(1, _ms(active_ttl_ms, "active_ttl_ms")), _tokens(budget, "budget")]
    return Op(lambda pipe: eval_script(pipe, "gpu_admission", names, args), lambda r: None)


def wait_for_slot(keys: Keys, gpu: str, worker: str, timeout_s: float) -> Op[bool]:
    """Block until a share is handed to this worker (True) or `timeout_s` passes (False); then `ask`
    takes it. The timeout covers what hands nothing on: a lease that ran out."""
    key = keys.gpu_wake(gpu, worker)
    return Op(lambda pipe: pipe.blpop([key], timeout=max(0.001, timeout_s)), lambda r: r[0] is not None)


def urgent_end(keys: Keys, gpu: str, worker: str) -> Op[None]:
    """This worker's urgent step ran, and it keeps its share for its next ask (which may be urgent again):
    the paused workers go on unless another urgent grant is live."""
    names = _keys(keys, gpu)
    return Op(lambda pipe: eval_script(pipe, "gpu_admission", names, ["urgent_end", worker]), lambda r: None)


def urgent_grants(keys: Keys, gpu: str) -> Op[dict[str, str]]:
    """The GPU's urgent grants: worker id -> lease end (server ms); {} when none (the usual answer). One
    command, meant to ride on a round trip the worker makes anyway."""
    key = keys.gpu_urgent(gpu)
    return Op(lambda pipe: pipe.hgetall(key), lambda r: dict(r[0] or {}))


def gate_wait(keys: Keys, gpu: str, worker: str, bound_s: float) -> Op[GateWait]:
    """One round trip: while another worker's urgent grant is live, join the paused set and block until
    the last one ends (woken) or `bound_s` passes; with none live, return at once (not gated)."""
    check_id(worker, "worker id")
    if not bound_s > 0:
        raise ValueError(f"bound_s must be > 0, got {bound_s!r}")
    names = _keys(keys, gpu)
    wake = keys.gpu_gate_wake(gpu, worker)

    def build(pipe: Any) -> None:
        eval_script(pipe, "gpu_admission", names, ["gate", worker])
        pipe.blpop([wake], timeout=max(0.001, bound_s))

    def parse(r: list[Any]) -> GateWait:
        live, popped = int(r[0]), r[1]
        return GateWait(gated=live > 0, woken=popped is not None and popped[1] == "1")

    return Op(build, parse)


def add_gated(keys: Keys, gpu: str, function: str, steps: int, waited_ms: float, timeouts: int) -> Op[None]:
    """Add a worker's gated steps, the time they waited and how many ran to their bound to the GPU's
    gating counters (in total and per function)."""
    key = keys.gpu_gating(gpu)

    def build(pipe: Any) -> None:
        for suffix in ("", f"|{function}"):
            pipe.hincrby(key, f"gated_steps{suffix}", steps)
            pipe.hincrbyfloat(key, f"gated_ms{suffix}", round(waited_ms, 3))
            pipe.hincrby(key, f"timeouts{suffix}", timeouts)

    return Op(build, lambda r: None)


def gating_counters(keys: Keys, gpu: str) -> Op[dict[str, float]]:
    """The GPU's gating counters: `urgent_grants`, `gated_steps`, `gated_ms`, `timeouts` (and the same per
    function, `gated_steps|<function>` ...); missing ones are 0."""

    def parse(r: list[Any]) -> dict[str, float]:
        out: dict[str, float] = {"urgent_grants": 0.0, "gated_steps": 0.0, "gated_ms": 0.0, "timeouts": 0.0}
        out.update({k: float(v) for k, v in (r[0] or {}).items()})
        return out

    return Op(lambda pipe: pipe.hgetall(keys.gpu_gating(gpu)), parse)


def _f(fields: dict[str, str], name: str) -> float | None:
    value = fields.get(name)
    return float(value) if value else None


def grants(keys: Keys, gpu: str, count: int = 1000) -> Op[list[Grant]]:
    """The grants among the most recent `count` records of the GPU's budget, oldest first."""

    def parse(r: list[Any]) -> list[Grant]:
        out = []
        for entry_id, f in reversed(r[0]):
            if f.get("event", "grant") != "grant":
                continue
            grant = Grant(
                entry_id=entry_id,
                worker=f.get("worker", ""),
                function=f.get("function", ""),
                margin_ms=float(f.get("margin_ms", 0)),
                active=int(f.get("active", 0)),
                waiters=int(f.get("waiters", 0)),
                runner_up_ms=_f(f, "runner_up_ms"),
                tokens=int(f.get("tokens", 0)),
                used=int(f.get("used", 0)),
                waited_ms=float(f.get("waited_ms", 0)),
                urgent=f.get("urgent") == "1",
            )
            out.append(grant)
        return out

    return Op(lambda pipe: pipe.xrevrange(keys.gpu_admissions(gpu), count=count), parse)


def releases(keys: Keys, gpu: str, count: int = 1000) -> Op[list[Release]]:
    """The releases among the most recent `count` records of the GPU's budget, oldest first."""

    def parse(r: list[Any]) -> list[Release]:
        return [
            Release(entry_id, f.get("worker", ""), float(f.get("held_ms", 0)), int(f.get("prefilled", -1)),
                    _f(f, "late_ms"))
            for entry_id, f in reversed(r[0])
            if f.get("event") == "release"
        ]  # fmt: skip

    return Op(lambda pipe: pipe.xrevrange(keys.gpu_admissions(gpu), count=count), parse)


# -- latency profiles ---------------------------------------------------------------------------
def get_profile(keys: Keys, backbone: str, gpu_model: str, shape: str) -> Op[dict[str, dict[str, str]]]:
    """kind -> its stored fields (`t0_ms`, `alpha_ms`, `samples`); {} when none was stored."""

    def parse(r: list[Any]) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for name, value in (r[0] or {}).items():
            kind, _, field = name.partition(".")
            out.setdefault(kind, {})[field] = value
        return out

    key = keys.latency_profile(backbone, gpu_model, shape)
    return Op(lambda pipe: pipe.hgetall(key), parse)


def put_profile(
    keys: Keys, backbone: str, gpu_model: str, shape: str, kind: str, fields: dict[str, str]
) -> Op[None]:
    """Store one step kind's fit (the latest measurement wins: the GPU's load is what it is now)."""
    if not kind or "." in kind:
        raise ValueError(f"profile kind {kind!r} must be a non-empty name without '.'")
    key = keys.latency_profile(backbone, gpu_model, shape)
    mapping = {f"{kind}.{k}": v for k, v in fields.items()}
    return Op(lambda pipe: pipe.hset(key, mapping=mapping), lambda r: None)
