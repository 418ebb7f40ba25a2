"""The Redis side of SLO-aware batching: one GPU's prefill slots and the latency profiles.

The slots (`lua/gpu_admission.lua`, one atomic script; `slots` per GPU, 1 by default): a worker that
wants to run a prefill `ask`s with its oldest waiting request's deadline and the expected step time
`T(b)`; the script grants a free slot to the waiter of smallest deadline margin (`lorafn.runtime.slo`
holds the policy and its reference `pick`). The holder `release`s it after its step (in the pipeline
the worker sends anyway); a lease ends the hold of a worker that died. A freed slot is handed straight
to the best waiter, which a blocked waiter learns from its wake list (`wait_for_slot`) without
polling. Workers with a running batch mark themselves `active` (M in the margin) and leave with
`idle`. Decode steps never ask. Every grant is appended to a capped stream (`admissions`) with the
runner-up's margin, which tests read.

Profiles: a hash per (backbone, GPU model, adapter shape) with the fit of each step kind, written by
the workers that measured it and read by a new worker as its prior.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lorafn.store.client import Op, eval_script
from lorafn.store.keys import Keys, check_id


@dataclass(frozen=True)
class SlotAnswer:
    """`granted`: the asker holds the slot. `margin_ms`: its own deadline margin as the script saw it,
    `active`: M. Refused: `other` is the holder or the waiter of smaller margin; `retry_ms` a hint."""

    granted: bool
    margin_ms: float
    active: int
    other: str = ""
    waiters: int = 0
    retry_ms: int = 0


@dataclass(frozen=True)
class Grant:
    """One recorded grant of the slot: the grantee's margin and the next smallest one, as decided."""

    entry_id: str
    worker: str
    function: str
    margin_ms: float
    active: int
    waiters: int
    runner_up_ms: float | None = None  # the next smallest margin among the waiters (None: alone)


def _keys(keys: Keys, gpu: str) -> list[str]:
    return [
        keys.gpu_slot(gpu), keys.gpu_waiting(gpu), keys.gpu_active(gpu), keys.gpu_admissions(gpu),
        keys.gpu_wake(gpu),
    ]  # fmt: skip


def _ms(value: float, what: str) -> int:
    if not value >= 0:
        raise ValueError(f"{what} must be >= 0 ms, got {value!r}")
    return int(value)


def _slots(slots: int) -> int:
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
    return slots


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
    slots: int = 1,
) -> Op[SlotAnswer]:
    """Ask one of the GPU's `slots` prefill slots for the step this worker wants to run (module doc)."""
    check_id(worker, "worker id")
    args = [
        "ask", worker, function, f"{deadline_ms:.1f}", f"{max(0.0, t_ms):.3f}", _ms(lease_ms, "lease_ms"),
        max(1, _ms(waiter_ttl_ms, "waiter_ttl_ms")), max(1, _ms(active_ttl_ms, "active_ttl_ms")),
        _slots(slots),
    ]  # fmt: skip
    names = _keys(keys, gpu)

    def parse(r: list[Any]) -> SlotAnswer:
        code, margin, active, *rest = r[0]
        if int(code) == 1:
            return SlotAnswer(True, float(margin), int(active), waiters=int(rest[0]))
        return SlotAnswer(False, float(margin), int(active), other=str(rest[0]), retry_ms=int(rest[1]))

    return Op(lambda pipe: eval_script(pipe, "gpu_admission", names, args), parse)


def release(keys: Keys, gpu: str, worker: str, active_ttl_ms: float, slots: int = 1) -> Op[bool]:
    """Free the slot if this worker holds it, handing it to the best waiter; True when it held it."""
    names = _keys(keys, gpu)
    args = ["release", worker, max(1, _ms(active_ttl_ms, "active_ttl_ms")), _slots(slots)]
    return Op(lambda pipe: eval_script(pipe, "gpu_admission", names, args), lambda r: bool(r[0]))


def mark_active(keys: Keys, gpu: str, worker: str, ttl_ms: float) -> Op[int]:
    """This worker has a running batch on the GPU (for `ttl_ms`); returns M, the active batches."""
    names = _keys(keys, gpu)
    args = ["active", worker, max(1, _ms(ttl_ms, "ttl_ms"))]
    return Op(lambda pipe: eval_script(pipe, "gpu_admission", names, args), lambda r: int(r[0]))


def mark_idle(keys: Keys, gpu: str, worker: str, active_ttl_ms: float, slots: int = 1) -> Op[None]:
    """This worker's batch is empty: out of the active set and the waiters; its slot, if held, handed on."""
    names = _keys(keys, gpu)
    args = ["idle", worker, max(1, _ms(active_ttl_ms, "active_ttl_ms")), _slots(slots)]
    return Op(lambda pipe: eval_script(pipe, "gpu_admission", names, args), lambda r: None)


def wait_for_slot(keys: Keys, gpu: str, worker: str, timeout_s: float) -> Op[bool]:
    """Block until the slot is handed to this worker (True) or `timeout_s` passes (False); then `ask`
    takes it. The timeout covers what hands nothing on: a lease that ran out."""
    key = keys.gpu_wake(gpu, worker)
    return Op(lambda pipe: pipe.blpop([key], timeout=max(0.001, timeout_s)), lambda r: r[0] is not None)


def grants(keys: Keys, gpu: str, count: int = 1000) -> Op[list[Grant]]:
    """The most recent grants of the GPU's slot, oldest first."""

    def parse(r: list[Any]) -> list[Grant]:
        out = []
        for entry_id, f in reversed(r[0]):
            grant = Grant(
                entry_id=entry_id,
                worker=f.get("worker", ""),
                function=f.get("function", ""),
                margin_ms=float(f.get("margin_ms", 0)),
                active=int(f.get("active", 0)),
                waiters=int(f.get("waiters", 0)),
                runner_up_ms=float(f["runner_up_ms"]) if f.get("runner_up_ms") else None,
            )
            out.append(grant)
        return out

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
