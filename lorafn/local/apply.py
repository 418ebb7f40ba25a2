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

from lorafn.api import FunctionRef, SecretKeyRef, parse_uri
from lorafn.api.adapters import AdapterProblem, parse_api_keys, validate_adapter
from lorafn.local.manifests import Manifest, ManifestError, parse_manifest
from lorafn.store import Keys, Store
from lorafn.store.backbones import BackboneRecord, get_backbone, put_backbone
from lorafn.store.registry import FunctionRecord, ensure_salt, hash_api_key, put_function, set_api_keys

log = logging.getLogger("lorafn.apply")


def secrets_file(state_dir: Path) -> Path:
    """Local stand-in for Kubernetes Secrets: YAML Secret documents, read by `lorafn apply`."""
    return state_dir / "secrets.yaml"


@dataclass(frozen=True)
class Applied:
    kind: str
    name: str
    detail: str


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
        plans.append((record, keys_for_fn, f"rank {info.rank}, targets {','.join(info.target_modules)}"))

    applied: list[Applied] = []
    for bb in backbone_records:
        store.run(put_backbone(keys, bb))
        applied.append(Applied("Backbone", bb.name, bb.model_dir))
    salt = store.run(ensure_salt(keys)) if plans else ""
    for record, fn_keys, detail in plans:
        store.run(put_function(keys, record))
        store.run(set_api_keys(keys, record.function, [hash_api_key(salt, k) for k in fn_keys]))
        if record.public:
            log.warning(
                "function %s is PUBLIC: anyone who reaches the gateway can invoke it", record.function
            )
        applied.append(Applied("LoRAFunction", record.function, detail))
    return applied


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
