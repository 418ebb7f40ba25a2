"""kopf handlers: thin. Each validates the body into the pydantic spec, calls the resource's reconcile
(`backbone.reconcile`, `function.reconcile`: they read the world at the edges, Kubernetes via `kube` and
Redis via `registry`, ask the pure builders/reducers what to do, and do it) and writes its status.

Level-based: create, update, resume (operator restart) and a periodic timer all run the same
reconcile; running it twice changes nothing the second time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import kopf
import redis
from pydantic import BaseModel, ValidationError

from lorafn.api.specs import BackboneSpec, FunctionRef, LoRAFunctionSpec
from lorafn.operator import backbone, builders, events, function, kube, reducers, registry
from lorafn.operator.config import OperatorConfig

GROUP_VERSION = ("lorafn.io", "v1alpha1")
_BOOT_CONFIG = OperatorConfig()  # only for decorator arguments (timer interval)
_INTERVAL = _BOOT_CONFIG.reconcile_interval_s


def _plain(value: Any) -> Any:
    """kopf bodies are mapping views; the builders want plain dicts."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


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


# --- shared steps -----------------------------------------------------------------------------------


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


# --- Backbone ---------------------------------------------------------------------------------------


@kopf.on.resume(*GROUP_VERSION, "backbones")
@kopf.on.create(*GROUP_VERSION, "backbones")
@kopf.on.update(*GROUP_VERSION, "backbones", field="spec")
def backbone_changed(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    plain = _plain(body)
    try:
        BackboneSpec.model_validate(plain.get("spec") or {})
    except ValidationError as exc:
        status, message = backbone.invalid_status(plain, exc)
        patch.status.update(reducers.status_patch(plain.get("status"), status))
        events.post(body, "Warning", "InvalidSpec", message)
        raise kopf.PermanentError(message) from None
    _reconcile_into(patch, plain, backbone.reconcile, memo, logger)


@kopf.timer(*GROUP_VERSION, "backbones", interval=_INTERVAL, initial_delay=_INTERVAL)
def backbone_timer(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    _timer_pass(patch, _plain(body), BackboneSpec, backbone.reconcile, memo, logger)


@kopf.on.delete(*GROUP_VERSION, "backbones")
def backbone_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Owner references let the garbage collector do this too; deleting here makes it prompt."""
    with _Edges():
        backbone.delete(body["metadata"]["name"], memo.config, memo.kube, memo.registry)


# --- LoRAFunction -----------------------------------------------------------------------------------


@kopf.on.resume(*GROUP_VERSION, "lorafunctions")
@kopf.on.create(*GROUP_VERSION, "lorafunctions")
@kopf.on.update(*GROUP_VERSION, "lorafunctions", field="spec")
def function_changed(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    plain = _plain(body)
    ref = FunctionRef(namespace=plain["metadata"]["namespace"], name=plain["metadata"]["name"])
    try:
        LoRAFunctionSpec.model_validate(plain.get("spec") or {})
    except ValidationError as exc:
        status, message = function.invalid_status(plain, exc)
        patch.status.update(reducers.status_patch(plain.get("status"), status))
        with _Edges():
            function.stop(memo.config, memo.kube, memo.registry, ref)
        events.post(body, "Warning", status["conditions"][-1]["reason"], message)
        raise kopf.PermanentError(message) from None
    _reconcile_into(patch, plain, function.reconcile, memo, logger)


@kopf.timer(*GROUP_VERSION, "lorafunctions", interval=_INTERVAL, initial_delay=_INTERVAL)
def function_timer(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    _timer_pass(patch, _plain(body), LoRAFunctionSpec, function.reconcile, memo, logger)


@kopf.on.delete(*GROUP_VERSION, "lorafunctions")
def function_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """The finalizer's work: drop the Redis entries and the workers (the Service goes by owner ref)."""
    ref = FunctionRef(namespace=body["metadata"]["namespace"], name=body["metadata"]["name"])
    with _Edges():
        function.stop(memo.config, memo.kube, memo.registry, ref)
        if memo.config.function_services:
            memo.kube.delete(f"{kube.services(ref.namespace)}/{builders.function_service_name(ref)}")
