"""The operator's Redis edge, over `lorafn.store` (the one module that knows the keys).

Registration uses the store's registry, so the gateway sees exactly what the operator wrote: the
function's record (spec, model and adapter directories as the pods see them), the HMAC-SHA256 hashes
of its API keys under the deployment's salt (`set_api_keys`; plaintext keys never reach Redis), and the
backbone's record. What the controller asks for and knows is read through `lorafn.store.control`:
desired replica counts per function, desired pool pods per backbone and GPU, the pods it stopped
(retiring), and each function's status (last cold start, why it waits). The operator writes the GPU
inventory the controller plans over (`merge_gpu`: one entry per selected GPU, with the backbones whose
server pod is Ready there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from lorafn.api.specs import FunctionRef
from lorafn.store import Keys, Store, combine, control
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
from lorafn.store.workers import server_time_ms


class RegistrationProblem(ValueError):
    """The function cannot be registered as it stands; `reason` is a condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _read_int(raw: Any) -> int | None:
    try:
        return None if raw in (None, "") else int(raw)
    except (TypeError, ValueError):
        return None


class Registry:
    """Writes only when something differs, so a level-based reconcile every few seconds is quiet."""

    def __init__(self, url: str, prefix: str = "lorafn") -> None:
        self.store = Store(url, socket_timeout_s=5.0)
        self.keys = Keys(prefix)
        self._reported_exits: set[tuple[str, str]] = set()  # (pod, termination) told to the controller

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
        self.store.run(
            combine(delete_function(self.keys, str(ref)), control.clear_desired_replicas(self.keys, str(ref)))
        )

    def register_backbone(self, name: str, model_dir: str, dtype: str, spec: dict[str, Any]) -> None:
        record = BackboneRecord(name=name, model_dir=model_dir, dtype=dtype, spec=spec)
        if self.store.run(get_backbone(self.keys, name)) != record:
            self.store.run(put_backbone(self.keys, record))

    def unregister_backbone(self, name: str) -> None:
        self.store.run(
            combine(
                delete_backbone(self.keys, name),
                control.clear_desired_standby(self.keys, name),
                control.clear_standby_kv(self.keys, name),
                control.drop_backbone_from_gpus(self.keys, name),
            )
        )

    def desired_replicas(self, ref: FunctionRef) -> int | None:
        """The controller's ask (None when it has not said)."""
        return self.store.run(control.desired_replicas(self.keys, [str(ref)]))[str(ref)]

    def standby_asks(
        self, backbone: str
    ) -> tuple[dict[tuple[str, str | None], int], dict[tuple[str, str | None], int]]:
        """The controller's asks of pool pods and the KV budgets (MiB) it granted them, per (GPU id, shape),
        in one round trip: counts read before budgets (the controller writes a budget before its count),
        so a new pod of a raised count gets the budget that came with it."""
        return self.store.run(
            combine(control.desired_standby(self.keys, backbone), control.standby_kv(self.keys, backbone))
        )

    def function_status(self, ref: FunctionRef) -> FunctionStatus:
        fields = self.store.run(control.statuses(self.keys, [str(ref)]))[str(ref)]
        return FunctionStatus(
            last_cold_start_ms=_read_int(fields.get("last_cold_start_ms")),
            wait_reason=fields.get("wait_reason") or None,
        )

    def retiring(self) -> dict[str, int]:
        """Pods (worker ids) the controller stopped -> when (ms)."""
        return self.store.run(control.retiring(self.keys))

    def unretire(self, names: list[str]) -> None:
        self.store.run(control.unretire(self.keys, names))

    def put_gpu(self, gpu_id: str, node: str, total_bytes: int, backbone: str, resident: int | None) -> None:
        """One GPU of `backbone` in the inventory; `resident`: its bytes there when its server is Ready."""
        self.store.run(control.merge_gpu(self.keys, gpu_id, node, total_bytes, backbone, resident))

    def now_ms(self) -> int:
        return self.store.run(server_time_ms())

    def report_pod_exits(self, exits: list[control.PodExit]) -> None:
        """Tell the controller about terminated worker containers, each once per operator process."""
        for e in exits:
            if (e.worker_id, e.marker) not in self._reported_exits:
                self.store.run(control.report_pod_exit(self.keys, e))
                self._reported_exits.add((e.worker_id, e.marker))


@dataclass(frozen=True)
class FunctionStatus:
    """What the controller wrote about a function (`<fn>:status`), as its LoRAFunction status shows it."""

    last_cold_start_ms: int | None = None
    wait_reason: str | None = None
