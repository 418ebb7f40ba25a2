"""kopf handlers: thin. Each validates the body into the pydantic spec, reads the world at the edges
(Kubernetes via `kube`, Redis via `registry`), asks the pure builders/reducers what to do, and does it.

Level-based: create, update, resume (operator restart) and a periodic timer all run the same
reconcile, which creates what is missing, deletes what is not wanted and writes the status the reducers
compute from what it observed; running it twice changes nothing the second time.
"""

from __future__ import annotations

import base64
import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import kopf
import redis
from pydantic import BaseModel, ValidationError

from lorafn.api.adapters import AdapterProblem, parse_api_keys, resolve_local_path, validate_adapter
from lorafn.api.errors import format_validation_error
from lorafn.api.specs import BackboneSpec, FunctionRef, LoRAFunctionSpec
from lorafn.operator import builders, kube, reducers, registry
from lorafn.operator.config import OperatorConfig

GROUP_VERSION = ("lorafn.io", "v1alpha1")
_BOOT_CONFIG = OperatorConfig()  # only for decorator arguments (timer interval)
_INTERVAL = _BOOT_CONFIG.reconcile_interval_s


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _plain(value: Any) -> Any:
    """kopf bodies are mapping views; the builders want plain dicts."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _event(body: Any, event_type: str, reason: str, message: str) -> None:
    """Post a Kubernetes event about `body` (kopf batches and posts them; tests replace this)."""
    (kopf.info if event_type == "Normal" else kopf.warn)(body, reason=reason, message=message)


class _Edges:
    """Maps edge failures to kopf's retry vocabulary: conflicts and outages are temporary."""

    def __enter__(self) -> _Edges:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, kopf.TemporaryError | kopf.PermanentError):
            return False
        if isinstance(exc, kube.Conflict):
            raise kopf.TemporaryError(f"conflict: {exc}", delay=2) from exc
        if isinstance(exc, kube.KubeError | httpx.HTTPError):
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=5) from exc
        if isinstance(exc, redis.RedisError):
            raise kopf.TemporaryError(f"Redis: {exc}", delay=5) from exc
        return False


# --- lifecycle --------------------------------------------------------------------------------------


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    config = OperatorConfig()
    # Progress and the last-handled spec live in annotations: our status schema is closed (structural).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="lorafn.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="lorafn.io", key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    # A timer mid-run when its object is deleted: look again within a second, not kopf's default minute,
    # so that the finalizer goes promptly.
    settings.background.cancellation_polling = 1.0
    settings.scanning.disabled = True  # no CRD/namespace watching: RBAC stays minimal
    settings.watching.server_timeout = 300
    memo.config = config
    memo.kube = kube.Kube(kube.connection(config))
    memo.registry = registry.Registry(config.redis_url, config.key_prefix)
    logger.info("lorafn operator: namespace %s, gpuSharing %s", config.namespace, config.gpu_sharing)


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_: Any) -> None:
    if getattr(memo, "kube", None) is not None:
        memo.kube.close()
    if getattr(memo, "registry", None) is not None:
        memo.registry.close()


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    conn = kube.connection(OperatorConfig())
    return kopf.ConnectionInfo(
        server=conn.server,
        token=conn.token,
        ca_path=conn.ca_path,
        insecure=conn.insecure,
        certificate_path=conn.cert_path,
        private_key_path=conn.key_path,
    )


# --- Backbone ---------------------------------------------------------------------------------------


def reconcile_backbone(
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
        _event(
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
        now=_now(),
        previous=body.get("status"),
    )


def _invalid_backbone(body: dict[str, Any], exc: ValidationError) -> tuple[dict[str, Any], str]:
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
                now=_now(),
                previous=(body.get("status") or {}).get("conditions"),
            )
        ],
    }
    return status, message


def _reconcile_into(
    patch: kopf.Patch,
    plain: dict[str, Any],
    reconcile: Callable[..., dict[str, Any]],
    memo: kopf.Memo,
    logger: Any,
) -> None:
    """Run the level-based reconcile of a valid object and write its status as a converging patch."""
    with _Edges():
        status = reconcile(plain, memo.config, memo.kube, memo.registry, logger)
    patch.status.update(reducers.status_patch(plain.get("status"), status))


def _timer_pass(
    patch: kopf.Patch,
    plain: dict[str, Any],
    spec_model: type[BaseModel],
    reconcile: Callable[..., dict[str, Any]],
    memo: kopf.Memo,
    logger: Any,
) -> None:
    """The periodic pass: the change handlers' reconcile, for live objects with a valid spec only."""
    if plain["metadata"].get("deletionTimestamp"):
        return
    try:
        spec_model.model_validate(plain.get("spec") or {})
    except ValidationError:
        return  # the change handler reported it; nothing changes until the spec does
    _reconcile_into(patch, plain, reconcile, memo, logger)


@kopf.on.resume(*GROUP_VERSION, "backbones")
@kopf.on.create(*GROUP_VERSION, "backbones")
@kopf.on.update(*GROUP_VERSION, "backbones", field="spec")
def backbone_changed(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    plain = _plain(body)
    try:
        BackboneSpec.model_validate(plain.get("spec") or {})
    except ValidationError as exc:
        status, message = _invalid_backbone(plain, exc)
        patch.status.update(reducers.status_patch(plain.get("status"), status))
        _event(body, "Warning", "InvalidSpec", message)
        raise kopf.PermanentError(message) from None
    _reconcile_into(patch, plain, reconcile_backbone, memo, logger)


@kopf.timer(*GROUP_VERSION, "backbones", interval=_INTERVAL, initial_delay=_INTERVAL)
def backbone_timer(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    _timer_pass(patch, _plain(body), BackboneSpec, reconcile_backbone, memo, logger)


@kopf.on.delete(*GROUP_VERSION, "backbones")
def backbone_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Owner references let the garbage collector do this too; deleting here makes it prompt."""
    config: OperatorConfig = memo.config
    name = body["metadata"]["name"]
    with _Edges():
        memo.registry.unregister_backbone(name)
        for pod in memo.kube.list(kube.pods(config.namespace), {builders.LABEL_BACKBONE: name}):
            memo.kube.delete(f"{kube.pods(config.namespace)}/{pod['metadata']['name']}")
        if config.gpu_sharing == "dra":
            for claim in memo.kube.list(kube.resource_claims(config), {builders.LABEL_BACKBONE: name}):
                memo.kube.delete(f"{kube.resource_claims(config)}/{claim['metadata']['name']}")


# --- LoRAFunction -----------------------------------------------------------------------------------


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


def reconcile_function(
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
    try:
        adapter_dir = resolve_local_path(spec.adapter.uri, config.pvc_root)
        if backbone_body is None:
            raise AdapterProblem(
                "WaitingForBackbone", f"Backbone {spec.backbone!r} not found; cannot check shapes"
            )
        backbone_spec = BackboneSpec.model_validate(backbone_body.get("spec") or {})
        backbone_dir = resolve_local_path(backbone_spec.model.uri, config.pvc_root)
        info = validate_adapter(adapter_dir, backbone_dir)
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
    wanted = [builders.worker_pod_name(ref, i) for i in range(desired)]
    existing = _fn_pods(k8s, config, ref)
    plan = reducers.plan_pods(wanted, existing)
    for pod_name in plan.delete:
        k8s.delete(f"{kube.pods(config.namespace)}/{pod_name}")
    created: list[dict[str, Any]] = []
    if plan.create and backbone_body is not None and backbone_spec is not None:
        for pod_name in plan.create:
            replica = wanted.index(pod_name)
            pod = builders.build_worker_pod(
                ref, replica, spec, backbone_body, backbone_spec, slots[replica % len(slots)], config
            )
            k8s.ensure(kube.pods(config.namespace), pod)
            created.append(pod)
    if plan.create or plan.delete:
        _event(body, "Normal", "Scaled", f"replicas -> {desired} (+{len(plan.create)} -{len(plan.delete)})")
    if config.function_services:
        k8s.ensure(kube.services(ref.namespace), builders.build_function_service(body, config))

    observed = [p for p in existing if p["metadata"]["name"] not in plan.delete] + created
    status = reducers.function_status(
        generation=meta.get("generation"),
        now=_now(),
        previous=previous,
        endpoint=endpoint,
        backbone=bb_state,
        adapter=ad_state,
        adapter_info=adapter_info,
        registered=registered,
        registration=registration,
        desired=desired,
        pods=observed,
        last_cold_start_ms=reg.last_cold_start_ms(ref),
    )
    _emit_transitions(body, previous, status)
    return status


def _emit_transitions(body: dict[str, Any], previous: dict[str, Any], status: dict[str, Any]) -> None:
    """One Kubernetes event per condition that changed status (not one per timer tick)."""
    old = {c["type"]: c.get("status") for c in previous.get("conditions") or []}
    for cond in status["conditions"]:
        if old.get(cond["type"]) != cond["status"]:
            event_type = "Normal" if cond["status"] == reducers.TRUE else "Warning"
            _event(body, event_type, cond["reason"], f"{cond['type']}={cond['status']}: {cond['message']}")


def _invalid_function(body: dict[str, Any], exc: ValidationError) -> tuple[dict[str, Any], str]:
    message = format_validation_error(exc)
    on_uri = any(tuple(e["loc"][:2]) == ("adapter", "uri") for e in exc.errors())
    if on_uri:
        cond_type = "AdapterReady"
        reason = "UnsupportedURIScheme" if "not supported" in message else "InvalidURI"
    else:
        cond_type, reason = "Ready", "InvalidSpec"
    status = reducers.failed_function_status(
        generation=body["metadata"].get("generation"),
        now=_now(),
        previous=body.get("status"),
        condition_type=cond_type,
        reason=reason,
        message=message,
    )
    return status, message


def _stop_function(memo: kopf.Memo, ref: FunctionRef) -> None:
    """Unregister and remove the workers (an invalid or deleted function serves nothing)."""
    memo.registry.unregister_function(ref)
    for pod in _fn_pods(memo.kube, memo.config, ref):
        memo.kube.delete(f"{kube.pods(memo.config.namespace)}/{pod['metadata']['name']}")


@kopf.on.resume(*GROUP_VERSION, "lorafunctions")
@kopf.on.create(*GROUP_VERSION, "lorafunctions")
@kopf.on.update(*GROUP_VERSION, "lorafunctions", field="spec")
def function_changed(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    plain = _plain(body)
    ref = FunctionRef(namespace=plain["metadata"]["namespace"], name=plain["metadata"]["name"])
    try:
        LoRAFunctionSpec.model_validate(plain.get("spec") or {})
    except ValidationError as exc:
        status, message = _invalid_function(plain, exc)
        patch.status.update(reducers.status_patch(plain.get("status"), status))
        with _Edges():
            _stop_function(memo, ref)
        _event(body, "Warning", status["conditions"][-1]["reason"], message)
        raise kopf.PermanentError(message) from None
    _reconcile_into(patch, plain, reconcile_function, memo, logger)


@kopf.timer(*GROUP_VERSION, "lorafunctions", interval=_INTERVAL, initial_delay=_INTERVAL)
def function_timer(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    _timer_pass(patch, _plain(body), LoRAFunctionSpec, reconcile_function, memo, logger)


@kopf.on.delete(*GROUP_VERSION, "lorafunctions")
def function_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """The finalizer's work: drop the Redis entries and the workers (the Service goes by owner ref)."""
    ref = FunctionRef(namespace=body["metadata"]["namespace"], name=body["metadata"]["name"])
    with _Edges():
        _stop_function(memo, ref)
        if memo.config.function_services:
            memo.kube.delete(f"{kube.services(ref.namespace)}/{builders.function_service_name(ref)}")
