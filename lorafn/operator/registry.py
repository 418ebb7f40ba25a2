"""The operator's Redis edge, over `lorafn.store` (the one module that knows the keys).

Registration uses the store's registry, so the gateway sees exactly what the operator wrote: the
function's record (spec, model and adapter directories as the pods see them), the HMAC-SHA256 hashes
of its API keys under the deployment's salt (`set_api_keys`; plaintext keys never reach Redis), and the
backbone's record. Three values have no store operation yet and are read here, under the store's key
names; nothing writes them until the controller of issue 10 does (so replicas and standby counts stay at
their minimum and status.lastColdStartMs is null):

    <keys.function(fn)>:desired_replicas       string int, the controller's ask
    <keys.backbone(name)>:desired_standby      string int (standby workers per GPU), the controller's ask
    <keys.stats(fn)> field last_cold_start_ms  for status.lastColdStartMs
"""

from __future__ import annotations

from typing import Any

import redis

from lorafn.api.specs import FunctionRef
from lorafn.store import Keys, Store
from lorafn.store.backbones import BackboneRecord, delete_backbone, get_backbone, put_backbone
from lorafn.store.registry import (
    FunctionRecord,
    delete_function,
    ensure_salt,
    get_function,
    hash_api_key,
    put_function,
    set_api_keys,
)


class RegistrationProblem(ValueError):
    """The function cannot be registered as it stands; `reason` is a condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def desired_replicas_key(keys: Keys, ref: FunctionRef) -> str:
    return f"{keys.function(str(ref))}:desired_replicas"


def desired_standby_key(keys: Keys, backbone: str) -> str:
    return f"{keys.backbone(backbone)}:desired_standby"


def _read_int(raw: Any) -> int | None:
    try:
        return None if raw is None else int(raw)
    except (TypeError, ValueError):
        return None


class Registry:
    """Writes only when something differs, so a level-based reconcile every few seconds is quiet."""

    def __init__(self, url: str, prefix: str = "lorafn") -> None:
        self.store = Store(url, socket_timeout_s=5.0)
        self.keys = Keys(prefix)

    def close(self) -> None:
        self.store.close()

    def register_function(
        self,
        ref: FunctionRef,
        *,
        spec: dict[str, Any],
        model_dir: str,
        adapter_dir: str,
        api_keys: list[str] | None,
        extra: dict[str, str],
    ) -> None:
        """Create or update the record and its keys; `api_keys` None: public (no auth configured)."""
        fn = str(ref)
        record = FunctionRecord(
            function=fn,
            spec=spec,
            model_dir=model_dir,
            adapter_dir=adapter_dir,
            public=api_keys is None,
            extra=extra,
        )
        if self.store.run(get_function(self.keys, fn)) != record:
            self.store.run(put_function(self.keys, record))
        salt = self.store.run(ensure_salt(self.keys))
        wanted = sorted({hash_api_key(salt, key) for key in api_keys or []})
        current = sorted(self.store.client.smembers(self.keys.function_keys(fn)))
        if wanted != current:
            try:
                self.store.run(set_api_keys(self.keys, fn, wanted))
            except redis.ResponseError as exc:
                if "API_KEY_TAKEN" in str(exc):
                    self.store.run(delete_function(self.keys, fn))
                    raise RegistrationProblem(
                        "APIKeyInUse", "an API key of this function already opens another function"
                    ) from None
                raise

    def unregister_function(self, ref: FunctionRef) -> None:
        self.store.run(delete_function(self.keys, str(ref)))
        self.store.client.delete(desired_replicas_key(self.keys, ref))

    def register_backbone(self, name: str, model_dir: str, dtype: str, spec: dict[str, Any]) -> None:
        record = BackboneRecord(name=name, model_dir=model_dir, dtype=dtype, spec=spec)
        if self.store.run(get_backbone(self.keys, name)) != record:
            self.store.run(put_backbone(self.keys, record))

    def unregister_backbone(self, name: str) -> None:
        self.store.run(delete_backbone(self.keys, name))
        self.store.client.delete(desired_standby_key(self.keys, name))

    def desired_replicas(self, ref: FunctionRef) -> int | None:
        return _read_int(self.store.client.get(desired_replicas_key(self.keys, ref)))

    def desired_standby(self, backbone: str) -> int | None:
        return _read_int(self.store.client.get(desired_standby_key(self.keys, backbone)))

    def last_cold_start_ms(self, ref: FunctionRef) -> int | None:
        return _read_int(self.store.client.hget(self.keys.stats(str(ref)), "last_cold_start_ms"))
