"""Reading the same YAML that `kubectl apply` takes, for `lorafn apply -f` on one machine.

Pure: text in, typed documents out. Errors name the document (its number in the file, from 1, and its
kind/name) and the field, so a user can fix the YAML without reading a stack trace.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from lorafn.api import API_VERSION, BackboneSpec, FunctionRef, LoRAFunctionSpec
from lorafn.api.errors import format_validation_error
from lorafn.api.specs import check_dns_label


class ManifestError(ValueError):
    """A document of the file cannot be applied; the message names where and why."""


@dataclass(frozen=True)
class BackboneDoc:
    name: str
    spec: BackboneSpec


@dataclass(frozen=True)
class FunctionDoc:
    ref: FunctionRef
    spec: LoRAFunctionSpec


@dataclass(frozen=True)
class SecretDoc:
    namespace: str
    name: str
    data: dict[str, str]


@dataclass
class Manifest:
    backbones: list[BackboneDoc] = field(default_factory=list)
    functions: list[FunctionDoc] = field(default_factory=list)
    secrets: list[SecretDoc] = field(default_factory=list)

    def secret(self, namespace: str, name: str) -> SecretDoc | None:
        for secret in self.secrets:
            if secret.namespace == namespace and secret.name == name:
                return secret
        return None


def _where(index: int, doc: dict[str, Any]) -> str:
    kind = doc.get("kind", "?")
    name = (doc.get("metadata") or {}).get("name", "?")
    return f"document {index + 1} ({kind}/{name})"  # 1-based: the way a person counts them


def _metadata(index: int, doc: dict[str, Any], namespaced: bool) -> tuple[str, str]:
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or "name" not in meta:
        raise ManifestError(f"{_where(index, doc)}: metadata.name is required")
    try:
        name = check_dns_label(meta["name"], "metadata.name")
        namespace = check_dns_label(meta.get("namespace", "default"), "metadata.namespace")
    except ValueError as exc:
        raise ManifestError(f"{_where(index, doc)}: {exc}") from None
    if not namespaced and "namespace" in meta:
        raise ManifestError(f"{_where(index, doc)}: Backbone is cluster-scoped; remove metadata.namespace")
    return namespace, name


def _secret_data(index: int, doc: dict[str, Any]) -> dict[str, str]:
    data: dict[str, str] = {}
    for key, value in (doc.get("data") or {}).items():
        try:
            data[str(key)] = base64.b64decode(str(value), validate=True).decode()
        except ValueError:
            raise ManifestError(f"{_where(index, doc)}: data.{key} is not valid base64") from None
    for key, value in (doc.get("stringData") or {}).items():
        data[str(key)] = str(value)
    return data


def parse_manifest(text: str) -> Manifest:
    """Parse a multi-document YAML file of Backbone, LoRAFunction and Secret objects."""
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise ManifestError(f"not valid YAML: {exc}") from None
    manifest = Manifest()
    for index, doc in enumerate(docs):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ManifestError(f"document {index + 1}: expected a mapping, got {type(doc).__name__}")
        kind = doc.get("kind")
        api_version = doc.get("apiVersion")
        if kind == "Secret":
            if api_version != "v1":
                raise ManifestError(f"{_where(index, doc)}: apiVersion must be v1 (got {api_version!r})")
            namespace, name = _metadata(index, doc, namespaced=True)
            manifest.secrets.append(SecretDoc(namespace, name, _secret_data(index, doc)))
            continue
        if kind not in ("Backbone", "LoRAFunction"):
            raise ManifestError(
                f"{_where(index, doc)}: kind {kind!r} is not supported here; "
                "expected Backbone, LoRAFunction or Secret"
            )
        if api_version != API_VERSION:
            raise ManifestError(
                f"{_where(index, doc)}: apiVersion must be {API_VERSION} (got {api_version!r})"
            )
        spec = doc.get("spec")
        if not isinstance(spec, dict):
            raise ManifestError(f"{_where(index, doc)}: spec is required and must be a mapping")
        try:
            if kind == "Backbone":
                _, name = _metadata(index, doc, namespaced=False)
                manifest.backbones.append(BackboneDoc(name, BackboneSpec.model_validate(spec)))
            else:
                namespace, name = _metadata(index, doc, namespaced=True)
                ref = FunctionRef(namespace=namespace, name=name)
                manifest.functions.append(FunctionDoc(ref, LoRAFunctionSpec.model_validate(spec)))
        except ValidationError as exc:
            raise ManifestError(f"{_where(index, doc)}: {format_validation_error(exc)}") from None
    return manifest
