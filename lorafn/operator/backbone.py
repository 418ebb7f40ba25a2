"""Backbone: the reconcile of one Backbone (GPU selection, server/standby pods, DRA claims, status).

Level-based: it creates what is missing, deletes what is not wanted and returns the status the pure
reducers compute from what it observed; running it twice changes nothing the second time. The kopf
handlers in `handlers.py` validate and call it.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from lorafn.api.errors import format_validation_error
from lorafn.api.specs import BackboneSpec
from lorafn.operator import builders, events, kube, reducers, registry
from lorafn.operator.config import OperatorConfig


def reconcile(
    body: dict[str, Any], config: OperatorConfig, k8s: kube.Kube, reg: registry.Registry, logger: Any
) -> dict[str, Any]:
    """Make the pods/claims of a Backbone match its spec; return its new status."""
    name = body["metadata"]["name"]
    spec = BackboneSpec.model_validate(body.get("spec") or {})
    slots, problems = builders.select_gpu_slots(spec, k8s.list(kube.NODES), config)
    num_standby = reducers.clamp_replicas(
        reg.desired_standby(name), spec.warm_pool.min_standby, spec.warm_pool.max_standby
    )
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

    wanted: dict[str, dict[str, Any]] = {}
    servers: dict[str, str] = {}
    for slot in slots:
        server = builders.build_server_pod(body, spec, slot, config)
        wanted[server["metadata"]["name"]] = server
        servers[slot.slot_id] = server["metadata"]["name"]
        for k in range(num_standby):
            standby = builders.build_standby_pod(body, spec, slot, k, config)
            wanted[standby["metadata"]["name"]] = standby
    existing = [
        p
        for p in k8s.list(kube.pods(config.namespace), {builders.LABEL_BACKBONE: name})
        if p["metadata"]["labels"].get(builders.LABEL_COMPONENT)
        in (builders.COMPONENT_SERVER, builders.COMPONENT_STANDBY)
    ]
    plan = reducers.plan_pods(list(wanted), existing)
    for pod_name in plan.delete:
        k8s.delete(f"{kube.pods(config.namespace)}/{pod_name}")
    for pod_name in plan.create:
        k8s.ensure(kube.pods(config.namespace), wanted[pod_name])
    if plan.create or plan.delete:
        events.post(
            body,
            "Normal",
            "Reconciled",
            f"created {len(plan.create)} pod(s), deleted {len(plan.delete)} on {len(slots)} GPU(s)",
        )
    observed = [p for p in existing if p["metadata"]["name"] not in plan.delete]
    observed += [wanted[name] for name in plan.create]  # just created: exist, not ready
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
