"""LoRAFunction: the reconcile of one function (adapter check, API keys, registration, workers, status).

Level-based like `backbone.py`; the kopf handlers in `handlers.py` validate and call it.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lorafn.api.adapters import AdapterProblem, parse_api_keys, resolve_local_path, validate_adapter
from lorafn.api.errors import format_validation_error
from lorafn.api.sizing import MiB, kv_budget_bytes, kv_bytes_per_token
from lorafn.api.specs import BackboneSpec, FunctionRef, LoRAFunctionSpec
from lorafn.operator import builders, events, kube, reducers, registry
from lorafn.operator.config import OperatorConfig


def _fn_pods(k8s: kube.Kube, config: OperatorConfig, ref: FunctionRef) -> list[dict[str, Any]]:
    return k8s.list(
        kube.pods(config.namespace),
        {builders.LABEL_FN_NAMESPACE: ref.namespace, builders.LABEL_FN_NAME: ref.name},
    )


def _ready_slots(backbone_body: dict[str, Any] | None) -> list[builders.GPUSlot]:
    gpus = ((backbone_body or {}).get("status") or {}).get("gpus") or []
    slots = [
        builders.GPUSlot(node=g["node"], index=int(g.get("index", 0)), uuid=g.get("uuid"))
        for g in gpus
        if g.get("ready") and g.get("node") is not None
    ]
    return sorted(slots, key=lambda s: s.slot_id)


def _api_keys(
    k8s: kube.Kube, ref: FunctionRef, spec: LoRAFunctionSpec
) -> tuple[list[str] | None, bool, str, str]:
    """(keys, ok, reason, message); keys None means public (no apiKeySecretRef)."""
    secret_ref = spec.auth.api_key_secret_ref
    if secret_ref is None:
        return None, True, "NoAuth", "no apiKeySecretRef: the gateway admits any caller"
    where = f"Secret {ref.namespace}/{secret_ref.name}"
    secret = k8s.get(kube.secret(ref.namespace, secret_ref.name))
    if secret is None:
        return [], False, "SecretNotFound", f"{where} not found"
    raw = (secret.get("data") or {}).get(secret_ref.key)
    if raw is not None:
        text = base64.b64decode(raw).decode()
    else:
        text = (secret.get("stringData") or {}).get(secret_ref.key)
    if text is None:
        return [], False, "SecretKeyNotFound", f"{where} has no key {secret_ref.key!r}"
    keys = parse_api_keys(text)
    if not keys:
        return [], False, "NoAPIKeys", f"{where} key {secret_ref.key!r} holds no keys"
    return keys, True, "APIKeys", f"{len(keys)} API key(s)"


def reconcile(
    body: dict[str, Any], config: OperatorConfig, k8s: kube.Kube, reg: registry.Registry, logger: Any
) -> dict[str, Any]:
    """Check, register, scale one LoRAFunction; return its new status (the spec is already valid)."""
    meta = body["metadata"]
    ref = FunctionRef(namespace=meta["namespace"], name=meta["name"])
    spec = LoRAFunctionSpec.model_validate(body.get("spec") or {})
    previous = body.get("status") or {}

    backbone_body = k8s.get(kube.backbone(spec.backbone))
    bb_state = reducers.backbone_ready(backbone_body)
    adapter_info = None
    backbone_spec = None
    kv_budget_mib: int | None = None
    try:
        refused = config.uri_policy().refusal(spec.adapter.uri, ref.namespace, os.path.realpath)
        if refused is not None:
            raise AdapterProblem(*refused)
        adapter_dir = resolve_local_path(spec.adapter.uri, config.pvc_root)
        if backbone_body is None:
            raise AdapterProblem(
                "WaitingForBackbone", f"Backbone {spec.backbone!r} not found; cannot check shapes"
            )
        backbone_spec = BackboneSpec.model_validate(backbone_body.get("spec") or {})
        backbone_dir = resolve_local_path(backbone_spec.model.uri, config.pvc_root)
        info = validate_adapter(adapter_dir, backbone_dir)
        kv_budget_mib = _kv_budget_mib(spec, backbone_spec, backbone_dir, config)
        adapter_info = info.to_status()
        modules = ", ".join(info.target_modules)
        ad_state = (True, "AdapterValid", f"LoRA rank {info.rank} on {modules} ({info.dtype})")
    except AdapterProblem as problem:
        ad_state = (False, problem.reason, problem.message)
    except ValidationError as exc:
        ad_state = (False, "BackboneInvalid", format_validation_error(exc))

    api_keys, keys_ok, key_reason, key_message = _api_keys(k8s, ref, spec)
    registration = (keys_ok, key_reason, key_message)
    endpoint = builders.endpoint_url(config, ref)
    registered = False
    if bb_state[0] and ad_state[0] and keys_ok and backbone_spec is not None and adapter_info is not None:
        try:
            reg.register_function(
                ref,
                spec=spec.to_k8s(),
                model_dir=builders.pod_path(backbone_spec.model.uri),
                adapter_dir=builders.pod_path(spec.adapter.uri),
                api_keys=api_keys,
                extra={
                    "generation": str(meta.get("generation")),
                    "backbone": spec.backbone,
                    "endpoint": endpoint,
                    "adapter_rank": str(adapter_info["rank"]),
                    "adapter_dtype": adapter_info["dtype"],
                    "adapter_targets": ",".join(adapter_info["targetModules"]),
                },
            )
            registered = True
        except registry.RegistrationProblem as problem:
            registration = (False, problem.reason, problem.message)
    else:
        reg.unregister_function(ref)

    desired = 0
    if registered:
        desired = reducers.clamp_replicas(
            reg.desired_replicas(ref), spec.scaling.min_replicas, spec.scaling.max_replicas
        )
    slots = _ready_slots(backbone_body)
    if not slots:
        desired = 0
    existing = _fn_pods(k8s, config, ref)
    reg.report_pod_exits(reducers.pod_exits(existing, str(ref)))  # failed starts: the controller backs off
    # Pods the controller stopped drain and end by themselves: not counted, and no other pod goes for them.
    retiring = reg.retiring()
    plan = reducers.plan_counted_pods(
        desired,
        existing,
        lambda i: builders.worker_pod_name(ref, i),
        retiring,
        reg.now_ms() if retiring else 0,
        int(config.retire_grace_s * 1000),
    )
    for pod_name in plan.delete:
        k8s.delete(f"{kube.pods(config.namespace)}/{pod_name}")
    created: list[dict[str, Any]] = []
    if plan.create and backbone_body is not None and backbone_spec is not None:
        for pod_name in plan.create:
            replica = int(pod_name.rsplit("-", 1)[1])
            pod = builders.build_worker_pod(
                ref, replica, spec, backbone_body, backbone_spec, slots[replica % len(slots)], config,
                kv_budget_mib,
            )  # fmt: skip
            k8s.ensure(kube.pods(config.namespace), pod)
            created.append(pod)
    reg.unretire([n for n in [*plan.delete, *plan.create] if n in retiring])
    if plan.create or plan.delete:
        events.post(
            body, "Normal", "Scaled", f"replicas -> {desired} (+{len(plan.create)} -{len(plan.delete)})"
        )
    if config.function_services:
        k8s.ensure(kube.services(ref.namespace), builders.build_function_service(body, config))

    observed = [p for p in existing if p["metadata"]["name"] not in plan.delete] + created
    controller_view = reg.function_status(ref)
    status = reducers.function_status(
        generation=meta.get("generation"),
        now=events.now(),
        previous=previous,
        endpoint=endpoint,
        backbone=bb_state,
        adapter=ad_state,
        adapter_info=adapter_info,
        registered=registered,
        registration=registration,
        desired=desired,
        pods=observed,
        last_cold_start_ms=controller_view.last_cold_start_ms,
        wait_reason=controller_view.wait_reason if registered else None,
    )
    _emit_transitions(body, previous, status)
    return status


def _kv_budget_mib(
    spec: LoRAFunctionSpec, backbone_spec: BackboneSpec, backbone_dir: Path, config: OperatorConfig
) -> int | None:
    """One worker's KV budget (the same rule as the controller's account: `api.sizing`); None when the
    backbone's config.json cannot be read (the pod then gets the default)."""
    try:
        model_config = json.loads((Path(backbone_dir) / "config.json").read_text())
        per_token = kv_bytes_per_token(model_config, backbone_spec.dtype)
    except (OSError, ValueError):
        return None
    return max(1, kv_budget_bytes(spec.resources, per_token, config.default_kv_mib * MiB) // MiB)


def _emit_transitions(body: dict[str, Any], previous: dict[str, Any], status: dict[str, Any]) -> None:
    """One Kubernetes event per condition that changed status (not one per timer tick)."""
    old = {c["type"]: c.get("status") for c in previous.get("conditions") or []}
    for cond in status["conditions"]:
        if old.get(cond["type"]) != cond["status"]:
            event_type = "Normal" if cond["status"] == reducers.TRUE else "Warning"
            events.post(
                body, event_type, cond["reason"], f"{cond['type']}={cond['status']}: {cond['message']}"
            )


def invalid_status(body: dict[str, Any], exc: ValidationError) -> tuple[dict[str, Any], str]:
    message = format_validation_error(exc)
    on_uri = any(tuple(e["loc"][:2]) == ("adapter", "uri") for e in exc.errors())
    if on_uri:
        cond_type = "AdapterReady"
        reason = "UnsupportedURIScheme" if "not supported" in message else "InvalidURI"
    else:
        cond_type, reason = "Ready", "InvalidSpec"
    status = reducers.failed_function_status(
        generation=body["metadata"].get("generation"),
        now=events.now(),
        previous=body.get("status"),
        condition_type=cond_type,
        reason=reason,
        message=message,
    )
    return status, message


def stop(config: OperatorConfig, k8s: kube.Kube, reg: registry.Registry, ref: FunctionRef) -> None:
    """Unregister and remove the workers (an invalid or deleted function serves nothing)."""
    reg.unregister_function(ref)
    for pod in _fn_pods(k8s, config, ref):
        k8s.delete(f"{kube.pods(config.namespace)}/{pod['metadata']['name']}")
