"""`lorafn apply -f FILE`: register Backbones and LoRAFunctions with the running local platform.

The same checks as the operator: the backbone must exist, the adapter URI must resolve to a PEFT LoRA
adapter that fits the backbone, and every function needs API keys (from a Secret in the same file, the
local secrets file, or `--api-key`) unless `--no-auth` says it is public.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from lorafn.api import FunctionRef, SecretKeyRef, parse_uri
from lorafn.api.adapters import AdapterProblem, parse_api_keys, shared_adapter_dirs, validate_adapter
from lorafn.local.manifests import Manifest, ManifestError, parse_manifest
from lorafn.store import Keys, Op, Store, combine, control
from lorafn.store.backbones import BackboneRecord, delete_backbone, get_backbone, list_backbones, put_backbone
from lorafn.store.registry import (
    FunctionRecord,
    delete_function,
    ensure_salt,
    get_function,
    hash_api_key,
    list_functions,
    lookup_api_key,
    put_function,
    set_api_keys,
)

log = logging.getLogger("lorafn.apply")


def secrets_file(state_dir: Path) -> Path:
    """Local stand-in for Kubernetes Secrets: YAML Secret documents, read by `lorafn apply`."""
    return state_dir / "secrets.yaml"


@dataclass(frozen=True)
class Applied:
    kind: str
    name: str
    detail: str
    action: str = "configured"  # kubectl's words: created (new) | configured (replaced)

    def line(self) -> str:
        """What `lorafn apply` and the demo print for it, kubectl-style."""
        return f"{self.kind.lower()}/{self.name} {self.action} ({self.detail})"


def _local_dir(uri: str, what: str) -> Path:
    parsed = parse_uri(uri)
    if parsed.scheme != "file":
        raise ManifestError(
            f"{what} {uri}: locally only file:// URIs resolve (pvc:// needs a cluster; see docs/operator.md)"
        )
    path = Path(parsed.local_path())
    if not path.is_dir():
        raise ManifestError(f"{what} {uri}: directory {path} does not exist")
    return path


def _max_context(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 0)


def apply_manifest(
    store: Store,
    keys: Keys,
    manifest: Manifest,
    local_secrets: Manifest | None = None,
    api_keys: list[str] | None = None,
    no_auth: bool = False,
) -> list[Applied]:
    """Validate everything first, then write: a file with one bad document changes nothing."""
    backbone_dirs: dict[str, Path] = {}
    backbone_records = []
    for doc in manifest.backbones:
        model_dir = _local_dir(doc.spec.model.uri, f"Backbone {doc.name}: spec.model.uri")
        if not (model_dir / "config.json").is_file():
            raise ManifestError(
                f"Backbone {doc.name}: {model_dir} has no config.json (not a model directory)"
            )
        backbone_dirs[doc.name] = model_dir
        backbone_records.append(BackboneRecord(doc.name, str(model_dir), doc.spec.dtype, doc.spec.to_k8s()))

    plans: list[tuple[FunctionRecord, list[str], str]] = []
    for doc in manifest.functions:
        where = f"LoRAFunction {doc.ref}"
        model_dir = backbone_dirs.get(doc.spec.backbone)
        if model_dir is None:
            existing = store.run(get_backbone(keys, doc.spec.backbone))
            if existing is None:
                raise ManifestError(
                    f"{where}: spec.backbone {doc.spec.backbone!r} is not registered; "
                    "apply the Backbone first (or in the same file)"
                )
            model_dir = Path(existing.model_dir)
        adapter_dir = _local_dir(doc.spec.adapter.uri, f"{where}: spec.adapter.uri")
        try:
            info = validate_adapter(adapter_dir, model_dir)
        except AdapterProblem as exc:
            raise ManifestError(f"{where}: adapter refused ({exc.reason}): {exc.message}") from None
        keys_for_fn = _function_keys(
            doc.ref, doc.spec.auth.api_key_secret_ref, manifest, local_secrets, where
        )
        keys_for_fn += list(api_keys or [])
        public = no_auth
        if not keys_for_fn and not public:
            raise ManifestError(
                f"{where}: no API keys: set spec.auth.apiKeySecretRef to a Secret (in this file or in the "
                "local secrets file), pass --api-key, or pass --no-auth to make it public"
            )
        record = FunctionRecord(
            function=str(doc.ref),
            spec=doc.spec.to_k8s(),
            model_dir=str(model_dir),
            adapter_dir=str(adapter_dir),
            max_context=_max_context(model_dir),
            public=public,
        )
        targets = ",".join(info.target_modules)
        record.extra.update(rank=str(info.rank), targets=targets)
        plans.append((record, keys_for_fn, f"rank {info.rank}, targets {targets}"))

    salt = store.run(ensure_salt(keys)) if plans else ""
    hashed = [(record, [hash_api_key(salt, k) for k in fn_keys], detail) for record, fn_keys, detail in plans]
    _check_keys_free(store, keys, hashed)

    # Everything is valid: write it in one round trip (no partial registration on a bad document).
    applied: list[Applied] = []
    ops: list[Op[Any]] = []
    for bb in backbone_records:
        existed = store.run(get_backbone(keys, bb.name)) is not None
        ops.append(put_backbone(keys, bb))
        applied.append(Applied("Backbone", bb.name, bb.model_dir, "configured" if existed else "created"))
    for record, key_hashes, detail in hashed:
        existed = store.run(get_function(keys, record.function)) is not None
        ops += [put_function(keys, record), set_api_keys(keys, record.function, key_hashes)]
        if record.public:
            log.warning(
                "function %s is PUBLIC: anyone who reaches the gateway can invoke it", record.function
            )
        applied.append(
            Applied("LoRAFunction", record.function, detail, "configured" if existed else "created")
        )
    try:
        store.run(combine(*ops))
    except redis.ResponseError as exc:  # a key taken between the check and the write (another apply)
        raise ManifestError(f"not applied: {str(exc).removeprefix('API_KEY_TAKEN ')}") from None
    # A function reading another's adapter directory, also through a symlink (issue 15): a warning here.
    names = store.run(list_functions(keys))
    records = store.run(combine(*(get_function(keys, n) for n in names))) if names else ()
    shared = shared_adapter_dirs({r.function: r.adapter_dir for r in records if r and r.adapter_dir})
    for record, _, _ in hashed:
        if record.function in shared:
            log.warning("function %s: %s", record.function, shared[record.function])
    return applied


def _check_keys_free(store: Store, keys: Keys, plans: list[tuple[FunctionRecord, list[str], str]]) -> None:
    """An API key opens one function: refuse a key that opens another registered function, or that this
    file gives to two functions (e.g. `--api-key` with a file of several functions)."""
    given: dict[str, str] = {}
    for record, key_hashes, _ in plans:
        for h in key_hashes:
            other = given.setdefault(h, record.function)
            if other != record.function:
                raise ManifestError(
                    f"LoRAFunction {record.function}: an API key it is given is also given to {other} in "
                    "this apply; an API key opens one function (apply files of several functions with "
                    "apiKeySecretRef, not --api-key)"
                )
    if not given:
        return
    hashes = list(given)
    owners = store.run(combine(*(lookup_api_key(keys, h) for h in hashes)))
    for h, owner in zip(hashes, owners, strict=True):
        if owner is not None and owner != given[h]:
            raise ManifestError(
                f"LoRAFunction {given[h]}: an API key it is given already opens function {owner}; "
                "an API key opens one function: use a new key (nothing was applied)"
            )


def _function_keys(
    ref: FunctionRef,
    secret_ref: SecretKeyRef | None,
    manifest: Manifest,
    local_secrets: Manifest | None,
    where: str,
) -> list[str]:
    if secret_ref is None:
        return []
    name, key = secret_ref.name, secret_ref.key
    secret = manifest.secret(ref.namespace, name) or (
        local_secrets.secret(ref.namespace, name) if local_secrets else None
    )
    if secret is None:
        raise ManifestError(
            f"{where}: spec.auth.apiKeySecretRef names Secret {ref.namespace}/{name}, which is neither in "
            "this file nor in the local secrets file"
        )
    if key not in secret.data:
        raise ManifestError(f"{where}: Secret {ref.namespace}/{name} has no key {key!r}")
    found = parse_api_keys(secret.data[key])
    if not found:
        raise ManifestError(f"{where}: Secret {ref.namespace}/{name} key {key!r} holds no API key")
    return found


def load_local_secrets(state_dir: Path) -> Manifest | None:
    path = secrets_file(state_dir)
    if not path.exists():
        return None
    return parse_manifest(path.read_text())


@dataclass(frozen=True)
class Deleted:
    kind: str
    name: str

    def line(self) -> str:
        return f'{self.kind.lower()} "{self.name}" deleted'


_STATUS_FIELDS = (
    "wait_reason", "last_cold_start_ms", "last_cold_path", "last_cold_at_ms", "start_failures",
    "last_failure", "last_failure_at_ms",
)  # fmt: skip


def delete_objects(
    store: Store, keys: Keys, functions: list[str], backbones: list[str], ignore_not_found: bool = False
) -> list[Deleted]:
    """Unregister functions (their API keys with them; the controller stops their workers, which drain)
    and backbones no remaining function uses. Checked first: nothing is deleted when one name is unknown
    or a backbone is still in use."""
    registered = set(store.run(list_functions(keys)))
    known_bbs = set(store.run(list_backbones(keys)))
    missing = [f"lorafunction/{f}" for f in functions if f not in registered]
    missing += [f"backbone/{b}" for b in backbones if b not in known_bbs]
    if missing and not ignore_not_found:
        raise ManifestError(f"not found: {', '.join(missing)} (nothing was deleted)")
    functions = [f for f in functions if f in registered]
    backbones = [b for b in backbones if b in known_bbs]
    remaining = registered - set(functions)
    for bb in backbones:
        users = []
        for f in sorted(remaining):
            record = store.run(get_function(keys, f))
            if record is not None and record.spec.get("backbone") == bb:
                users.append(f)
        if users:
            raise ManifestError(
                f"backbone/{bb} is used by {', '.join(users)}: delete those functions first "
                "(nothing was deleted)"
            )
    out: list[Deleted] = []
    for f in functions:
        store.run(delete_function(keys, f))
        # A function created again later starts with a clean status, not this one's wait reason.
        store.run(control.set_status(keys, f, **dict.fromkeys(_STATUS_FIELDS)))
        out.append(Deleted("LoRAFunction", f))
    for bb in backbones:
        store.run(delete_backbone(keys, bb))
        out.append(Deleted("Backbone", bb))
    return out
