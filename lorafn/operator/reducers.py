"""Pure status reducers and reconcile plans: observed state in, status dict or plan out, no I/O."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lorafn.operator.builders import (
    COMPONENT_SERVER,
    COMPONENT_STANDBY,
    LABEL_COMPONENT,
    LABEL_SLOT,
    GPUSlot,
    SlotProblem,
)
from lorafn.store.control import PodExit

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"


def condition(
    type_: str,
    status: str,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: str,
    previous: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A Kubernetes condition; `lastTransitionTime` moves only when `status` changes."""
    old = next((c for c in previous or [] if c.get("type") == type_), None)
    since = (
        old["lastTransitionTime"]
        if old and old.get("status") == status and old.get("lastTransitionTime")
        else now
    )
    out = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message[:1024],
        "lastTransitionTime": since,
    }
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def pod_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def pod_finished(pod: dict[str, Any]) -> bool:
    """A pod that will not run again (restartPolicy Never): it is replaced, not waited for."""
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def pod_exits(pods: list[dict[str, Any]], function: str) -> list[PodExit]:
    """Worker containers that terminated with a non-zero code (now or before their last restart), and pods
    that failed without one (evicted): what the controller counts as failed starts (controller's
    `KubernetesExecutor.exits`)."""
    out = []
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name") or ""
        status = pod.get("status") or {}
        seen = False
        for cs in status.get("containerStatuses") or []:
            for when in ("state", "lastState"):
                term = (cs.get(when) or {}).get("terminated")
                if not term:
                    continue
                seen = True
                code = term.get("exitCode")
                if isinstance(code, int) and code != 0:
                    restarts = int(cs.get("restartCount") or 0) - (1 if when == "lastState" else 0)
                    reason = term.get("reason") or "Error"
                    if term.get("message"):
                        reason += f": {str(term['message'])[:300]}"
                    marker = f"{cs.get('name', '')}/{restarts}/{term.get('finishedAt') or ''}"
                    out.append(PodExit(name, function, code, reason, marker))
        if not seen and status.get("phase") == "Failed":
            out.append(PodExit(name, function, None, status.get("reason") or "Failed", "pod"))
    return out


def pod_deleting(pod: dict[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def clamp_replicas(desired: int | None, min_replicas: int, max_replicas: int) -> int:
    """What the controller asks (None when it has not said), held within [min, max]."""
    if desired is None:
        return min_replicas
    return max(min_replicas, min(max_replicas, desired))


@dataclass(frozen=True)
class PodPlan:
    """Which pods to create (by name) and delete (by name) to reach the wanted set."""

    create: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)


def plan_pods(wanted: list[str], existing: list[dict[str, Any]]) -> PodPlan:
    """Create wanted names that are absent; delete unwanted ones and finished ones (to be recreated).

    A pod being deleted is left alone: its name is created again once it is gone.
    """
    by_name = {p["metadata"]["name"]: p for p in existing}
    create = [n for n in wanted if n not in by_name]
    delete = []
    for name, pod in sorted(by_name.items()):
        if pod_deleting(pod):
            continue
        if name not in wanted or pod_finished(pod):
            delete.append(name)
    return PodPlan(create=create, delete=delete)


def plan_counted_pods(
    desired: int,
    existing: list[dict[str, Any]],
    name_of: Callable[[int], str],
    retiring: dict[str, int],
    now_ms: int,
    retire_grace_ms: int,
) -> PodPlan:
    """Reach `desired` running pods named `name_of(i)`, given the pods the controller stopped.

    A retiring pod (its worker got `stop` and drains) is not counted and not replaced by deleting another:
    it ends by itself and is then removed like every finished pod; one still running `retire_grace_ms`
    after its stop is deleted. Pods are created at the lowest free indices; a surplus goes not-ready
    first, then highest index. `create` lists names in index order.
    """
    if desired < 0:
        raise ValueError(f"desired: must be >= 0, got {desired}")
    horizon = len(existing) + desired + 1
    index_of = {name_of(i): i for i in range(horizon)}
    delete: list[str] = []
    counted: list[tuple[str, dict[str, Any]]] = []
    for pod in existing:
        name = pod["metadata"]["name"]
        if pod_deleting(pod):
            continue
        if pod_finished(pod) or name not in index_of:
            delete.append(name)
        elif name in retiring:
            if now_ms - retiring[name] > retire_grace_ms:
                delete.append(name)
        else:
            counted.append((name, pod))
    surplus = len(counted) - desired
    if surplus > 0:
        counted.sort(key=lambda item: (pod_ready(item[1]), -index_of[item[0]]))
        delete += [name for name, _ in counted[:surplus]]
    taken = {p["metadata"]["name"] for p in existing}
    create = [n for n in (name_of(i) for i in range(horizon)) if n not in taken][: max(0, -surplus)]
    return PodPlan(create=create, delete=sorted(delete))


def backbone_status(
    *,
    slots: list[GPUSlot],
    problems: list[SlotProblem],
    pods: list[dict[str, Any]],
    server_names: dict[str, str],
    claim_names: dict[str, str],
    generation: int | None,
    now: str,
    previous: dict[str, Any] | None,
) -> dict[str, Any]:
    """Status of a Backbone from its slots and the pods that exist (server + standby per slot)."""
    previous = previous or {}
    old_conditions = previous.get("conditions") or []
    gpus = []
    for slot in slots:
        slot_pods = [p for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_SLOT) == slot.slot_id]
        server = [p for p in slot_pods if p["metadata"]["labels"].get(LABEL_COMPONENT) == COMPONENT_SERVER]
        standby = [p for p in slot_pods if p["metadata"]["labels"].get(LABEL_COMPONENT) == COMPONENT_STANDBY]
        entry: dict[str, Any] = {
            "slot": slot.slot_id,
            "node": slot.node,
            "index": slot.index,
            "server": server_names[slot.slot_id],
            "ready": bool(server) and pod_ready(server[0]),
            "standbyWorkers": len(standby),
            "readyStandbyWorkers": sum(pod_ready(p) for p in standby),
        }
        if slot.uuid:
            entry["uuid"] = slot.uuid
        if slot.product:
            entry["product"] = slot.product
        if slot.memory_mib is not None:
            entry["memoryMiB"] = slot.memory_mib
        if slot.slot_id in claim_names:
            entry["resourceClaim"] = claim_names[slot.slot_id]
        gpus.append(entry)
    ready = sum(1 for g in gpus if g["ready"])
    conditions = []
    if problems and not slots:
        sel_status, sel_reason = FALSE, problems[0].reason
    elif problems:
        sel_status, sel_reason = TRUE, "PartiallySelected"
    else:
        sel_status, sel_reason = TRUE, "Selected"
    sel_message = "; ".join(p.message for p in problems) or f"{len(slots)} GPU(s) selected"
    conditions.append(
        condition(
            "GPUsSelected",
            sel_status,
            sel_reason,
            sel_message,
            generation=generation,
            now=now,
            previous=old_conditions,
        )
    )
    if ready > 0:
        ready_cond = (TRUE, "ServersReady", f"{ready}/{len(slots)} backbone server(s) ready")
    elif slots:
        ready_cond = (FALSE, "ServersStarting", f"0/{len(slots)} backbone server(s) ready")
    else:
        ready_cond = (FALSE, "NoGPUs", "no GPU holds this backbone")
    conditions.append(
        condition("Ready", *ready_cond, generation=generation, now=now, previous=old_conditions)
    )
    if not slots:
        phase = "Failed" if problems else "Pending"
    elif ready == len(slots):
        phase = "Ready"
    else:
        phase = "Loading"
    return {
        "phase": phase,
        "observedGeneration": generation,
        "numGPUs": len(slots),
        "readyGPUs": ready,
        "gpus": gpus,
        "conditions": conditions,
    }


def backbone_ready(backbone_body: dict[str, Any] | None) -> tuple[bool, str, str]:
    """(ready, reason, message) of a Backbone as a LoRAFunction sees it."""
    if backbone_body is None:
        return False, "BackboneNotFound", "no Backbone of that name"
    status = backbone_body.get("status") or {}
    ready_gpus = status.get("readyGPUs") or 0
    if ready_gpus > 0:
        return True, "BackboneReady", f"loaded on {ready_gpus} GPU(s)"
    cond = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if cond is not None:
        return False, "BackboneNotReady", f"{cond.get('reason')}: {cond.get('message')}"
    return False, "BackboneNotReady", "the Backbone has no ready GPU yet"


def function_status(
    *,
    generation: int | None,
    now: str,
    previous: dict[str, Any] | None,
    endpoint: str,
    backbone: tuple[bool, str, str],
    adapter: tuple[bool, str, str],
    adapter_info: dict[str, Any] | None,
    registered: bool,
    registration: tuple[bool, str, str] = (True, "Registered", ""),
    desired: int,
    pods: list[dict[str, Any]],
    last_cold_start_ms: int | None,
    wait_reason: str | None = None,
) -> dict[str, Any]:
    """Status of a LoRAFunction. Ready means invocable: a warm worker or a cold start can serve it; while
    the controller says its requests wait (`wait_reason`: no GPU has room, start backoff), it is not."""
    previous = previous or {}
    old = previous.get("conditions") or []
    live = [p for p in pods if not pod_deleting(p) and not pod_finished(p)]
    ready_pods = sum(pod_ready(p) for p in live)
    bb_ok, bb_reason, bb_msg = backbone
    ad_ok, ad_reason, ad_msg = adapter
    invocable = bb_ok and ad_ok and registered
    if invocable and wait_reason:
        ready = (FALSE, "WaitingForCapacity", wait_reason)
    elif invocable:
        ready = (TRUE, "Invocable", f"{ready_pods} warm replica(s); others start on demand")
    elif not ad_ok:
        ready = (FALSE, ad_reason, ad_msg)
    elif not bb_ok:
        ready = (FALSE, bb_reason, bb_msg)
    elif not registration[0]:
        ready = (FALSE, registration[1], registration[2])
    else:
        ready = (FALSE, "NotRegistered", "not yet registered with the gateway")
    conditions = [
        condition(
            "BackboneReady",
            TRUE if bb_ok else FALSE,
            bb_reason,
            bb_msg,
            generation=generation,
            now=now,
            previous=old,
        ),
        condition(
            "AdapterReady",
            TRUE if ad_ok else FALSE,
            ad_reason,
            ad_msg,
            generation=generation,
            now=now,
            previous=old,
        ),
        condition("Ready", *ready, generation=generation, now=now, previous=old),
    ]
    if not invocable:
        phase = "Pending"
    elif len(live) != desired or ready_pods < desired:
        phase = "Scaling"
    elif desired == 0:
        phase = "Idle"
    else:
        phase = "Ready"
    status: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": generation,
        "replicas": len(live),
        "readyReplicas": ready_pods,
        "desiredReplicas": desired,
        "endpoint": endpoint,
        "lastColdStartMs": last_cold_start_ms,
        "conditions": conditions,
    }
    if adapter_info is not None:
        status["adapter"] = adapter_info
    return status


def failed_function_status(
    *,
    generation: int | None,
    now: str,
    previous: dict[str, Any] | None,
    condition_type: str,
    reason: str,
    message: str,
) -> dict[str, Any]:
    """Status for a spec that can never work until it is edited (InvalidSpec, bad URI scheme)."""
    old = (previous or {}).get("conditions") or []
    conditions = [c for c in old if c.get("type") not in (condition_type, "Ready")]
    conditions.append(
        condition(condition_type, FALSE, reason, message, generation=generation, now=now, previous=old)
    )
    if condition_type != "Ready":
        conditions.append(
            condition("Ready", FALSE, reason, message, generation=generation, now=now, previous=old)
        )
    return {"phase": "Failed", "observedGeneration": generation, "conditions": conditions}


def status_patch(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The merge patch that turns status `old` into `new`: {} when equal; keys `new` lacks become None
    (removed), so the stored status converges and a level-based re-check then writes nothing."""
    old = old or {}
    wanted = {k: v for k, v in new.items() if v is not None}
    patch = {k: v for k, v in wanted.items() if old.get(k) != v}
    patch.update({k: None for k in old if k not in wanted})
    return patch
