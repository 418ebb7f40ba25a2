"""Backbone: the reconcile of one Backbone (GPU selection, server/standby pods, DRA claims, status).

Level-based: it creates what is missing, deletes what is not wanted and returns the status the pure
reducers compute from what it observed; running it twice changes nothing the second time. The kopf
handlers in `handlers.py` validate and call it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lorafn.api.adapters import AdapterProblem, resolve_local_path
from lorafn.api.errors import format_validation_error
from lorafn.api.sizing import MiB
from lorafn.api.specs import BackboneSpec
from lorafn.operator import builders, events, kube, reducers, registry
from lorafn.operator.config import OperatorConfig
from lorafn.store import control


def reconcile(
    body: dict[str, Any], config: OperatorConfig, k8s: kube.Kube, reg: registry.Registry, logger: Any
) -> dict[str, Any]:
    """Make the pods/claims of a Backbone match its spec; return its new status."""
    name = body["metadata"]["name"]
    spec = BackboneSpec.model_validate(body.get("spec") or {})
    refused = config.uri_policy().refusal(spec.model.uri, None, os.path.realpath)
    if refused is not None:  # no pod may mount it: none runs, and no function can use the backbone
        delete(name, config, k8s, reg)
        return reducers.failed_function_status(
            generation=body["metadata"].get("generation"), now=events.now(), previous=body.get("status"),
            condition_type="Ready", reason=refused[0], message=refused[1],
        )  # fmt: skip
    slots, problems = builders.select_gpu_slots(spec, k8s.list(kube.NODES), config)
    asked, kv_asked = reg.standby_asks(name)
    reg.register_backbone(name, builders.pod_path(spec.model.uri), spec.dtype, spec.to_k8s())
    claims: dict[str, str] = {}
    if config.gpu_sharing == "dra":
        wanted_claims = {}
        for slot in slots:
            claim = builders.build_resource_claim(body, slot, config)
            wanted_claims[claim["metadata"]["name"]] = claim
            claims[slot.slot_id] = claim["metadata"]["name"]
        existing_claims = k8s.list(kube.resource_claims(config), {builders.LABEL_BACKBONE: name})
        for claim_name, claim in wanted_claims.items():
            if k8s.ensure(kube.resource_claims(config), claim):
                logger.info("created ResourceClaim %s", claim_name)
        for claim in existing_claims:
            if claim["metadata"]["name"] not in wanted_claims:
                k8s.delete(f"{kube.resource_claims(config)}/{claim['metadata']['name']}")

    existing = [
        p
        for p in k8s.list(kube.pods(config.namespace), {builders.LABEL_BACKBONE: name})
        if p["metadata"]["labels"].get(builders.LABEL_COMPONENT)
        in (builders.COMPONENT_SERVER, builders.COMPONENT_STANDBY)
    ]
    servers: dict[str, str] = {}
    wanted_servers: dict[str, dict[str, Any]] = {}
    for slot in slots:
        server = builders.build_server_pod(body, spec, slot, config)
        wanted_servers[server["metadata"]["name"]] = server
        servers[slot.slot_id] = server["metadata"]["name"]
    server_pods = [p for p in existing if _component(p) == builders.COMPONENT_SERVER]
    plan = reducers.plan_pods(list(wanted_servers), server_pods)
    to_create = {n: wanted_servers[n] for n in plan.create}
    to_delete = list(plan.delete)
    # Pool (standby) pods per GPU and adapter shape: as many as the controller asks there (standby ones and
    # those bound and still serving), within the warm-pool bounds; the pods it stopped end by themselves.
    retiring = reg.retiring()
    now_ms = reg.now_ms() if retiring else 0
    by_slot = {s.slot_id: s for s in slots}
    standby_pods = [p for p in existing if _component(p) == builders.COMPONENT_STANDBY]
    for pod in standby_pods:  # pods of GPUs no longer selected
        slot_id = (pod["metadata"].get("labels") or {}).get(builders.LABEL_SLOT)
        if slot_id not in by_slot and not reducers.pod_deleting(pod):
            to_delete.append(pod["metadata"]["name"])
    for slot in slots:
        on_slot = [
            p for p in standby_pods if p["metadata"]["labels"].get(builders.LABEL_SLOT) == slot.slot_id
        ]
        counts = control.standby_counts(
            asked, slot.gpu_id, spec.warm_pool.min_standby, spec.warm_pool.max_standby
        )
        shapes = {builders.shape_label(s): s for s in counts}
        for pod in on_slot:  # shapes no longer asked for: their pods go (count 0)
            label = pod["metadata"]["labels"].get(builders.LABEL_SHAPE, "any")
            shapes.setdefault(
                label, (pod["metadata"].get("annotations") or {}).get(builders.ANNOTATION_SHAPE)
            )
        for label, shape in sorted(shapes.items()):
            of_shape = [
                p for p in on_slot if p["metadata"]["labels"].get(builders.LABEL_SHAPE, "any") == label
            ]
            shape_plan = reducers.plan_counted_pods(
                counts.get(shape, 0),
                of_shape,
                lambda k, slot=slot, shape=shape: builders.standby_pod_name(name, slot, k, shape),
                retiring,
                now_ms,
                int(config.retire_grace_s * 1000),
            )
            to_delete += shape_plan.delete
            for pod_name in shape_plan.create:
                k = int(pod_name.rsplit("-", 1)[1])
                # the KV budget the controller granted this GPU's standbys of the shape (sized for the largest
                # function of it); pods already running keep theirs: a smaller one is not replaced (no churn,
                # the controller stops what it cannot use)
                to_create[pod_name] = builders.build_standby_pod(
                    body, spec, slot, k, config, shape, kv_budget_mib=kv_asked.get((slot.gpu_id, shape))
                )
    for pod_name in to_delete:
        k8s.delete(f"{kube.pods(config.namespace)}/{pod_name}")
    for pod in to_create.values():
        k8s.ensure(kube.pods(config.namespace), pod)
    reg.unretire([n for n in [*to_delete, *to_create] if n in retiring])
    if to_create or to_delete:
        events.post(
            body,
            "Normal",
            "Reconciled",
            f"created {len(to_create)} pod(s), deleted {len(to_delete)} on {len(slots)} GPU(s)",
        )
    observed = [p for p in existing if p["metadata"]["name"] not in to_delete]
    observed += list(to_create.values())  # just created: exist, not ready
    _write_inventory(name, spec, slots, observed, servers, config, reg, logger)
    return reducers.backbone_status(
        slots=slots,
        problems=problems,
        pods=observed,
        server_names=servers,
        claim_names=claims,
        generation=body["metadata"].get("generation"),
        now=events.now(),
        previous=body.get("status"),
    )


def _component(pod: dict[str, Any]) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(builders.LABEL_COMPONENT)


def _write_inventory(
    name: str,
    spec: BackboneSpec,
    slots: list[builders.GPUSlot],
    pods: list[dict[str, Any]],
    servers: dict[str, str],
    config: OperatorConfig,
    reg: registry.Registry,
    logger: Any,
) -> None:
    """Each selected GPU into the controller's inventory, with this backbone resident where its server pod
    is Ready. A GPU of unknown size (no memory label, no placement.devices memoryMiB) is left out: the
    controller cannot account for it."""
    ready = {p["metadata"]["name"] for p in pods if reducers.pod_ready(p)}
    size = _model_bytes(spec, config)
    for slot in slots:
        if slot.memory_mib is None:
            logger.warning(
                "GPU %s of %s: size unknown (label %s or placement.devices memoryMiB); not offered to the "
                "controller", slot.gpu_id, name, config.gpu_memory_label,
            )  # fmt: skip
            continue
        resident = size if servers[slot.slot_id] in ready else None
        reg.put_gpu(slot.gpu_id, slot.node, slot.memory_mib * MiB, name, resident)


def _model_bytes(spec: BackboneSpec, config: OperatorConfig) -> int:
    """The backbone's weight bytes on a GPU: its safetensors files, where the operator can see them (0 when
    it cannot: a file:// model on the node only)."""
    try:
        model_dir = resolve_local_path(spec.model.uri, config.pvc_root)
        return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    except (AdapterProblem, OSError):
        return 0


def invalid_status(body: dict[str, Any], exc: ValidationError) -> tuple[dict[str, Any], str]:
    message = format_validation_error(exc)
    status = {
        "phase": "Failed",
        "observedGeneration": body["metadata"].get("generation"),
        "conditions": [
            reducers.condition(
                "Ready",
                reducers.FALSE,
                "InvalidSpec",
                message,
                generation=body["metadata"].get("generation"),
                now=events.now(),
                previous=(body.get("status") or {}).get("conditions"),
            )
        ],
    }
    return status, message


def delete(name: str, config: OperatorConfig, k8s: kube.Kube, reg: registry.Registry) -> None:
    """Unregister the backbone and delete its pods and claims (owner references would too, later)."""
    reg.unregister_backbone(name)
    for pod in k8s.list(kube.pods(config.namespace), {builders.LABEL_BACKBONE: name}):
        k8s.delete(f"{kube.pods(config.namespace)}/{pod['metadata']['name']}")
    if config.gpu_sharing == "dra":
        for claim in k8s.list(kube.resource_claims(config), {builders.LABEL_BACKBONE: name}):
            k8s.delete(f"{kube.resource_claims(config)}/{claim['metadata']['name']}")
