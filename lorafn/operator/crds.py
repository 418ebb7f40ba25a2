"""The two CustomResourceDefinitions, derived from the pydantic specs in `lorafn.api.specs`.

One source: the pydantic models hold the fields, types, enums, bounds, defaults and descriptions; this
module turns their JSON schema into a Kubernetes *structural* OpenAPI v3 schema (no `$ref`, every node
typed, `nullable` instead of `anyOf [.., null]`, boolean `exclusiveMinimum`). Cross-field rules that
pydantic keeps in model validators (min <= max) cannot be read off a JSON schema; they are the one
hand-written part, `_CEL_RULES`, and a test feeds every invalid body that pydantic refuses to the CRD
schema + these CEL rules to prove the two agree.

`python -m lorafn.operator.crds` (or `scripts/render_manifests.sh`) writes the YAML files; a test checks
that the committed files equal what this module builds.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from lorafn.api.specs import GROUP, VERSION, BackboneSpec, LoRAFunctionSpec

# Cross-field rules of the model validators, by the path of the object they sit on (under `spec`).
_CEL_RULES: dict[str, dict[tuple[str, ...], list[dict[str, str]]]] = {
    "Backbone": {
        ("warmPool",): [
            {
                "rule": "!has(self.minStandby) || !has(self.maxStandby) || "
                "self.minStandby <= self.maxStandby",
                "message": "warmPool.minStandby must be <= warmPool.maxStandby",
                "reason": "FieldValueInvalid",
                "fieldPath": ".minStandby",
            }
        ]
    },
    "LoRAFunction": {
        ("scaling",): [
            {
                "rule": "!has(self.minReplicas) || !has(self.maxReplicas) || "
                "self.minReplicas <= self.maxReplicas",
                "message": "scaling.minReplicas must be <= scaling.maxReplicas",
                "reason": "FieldValueInvalid",
                "fieldPath": ".minReplicas",
            }
        ]
    },
}

_DROP_KEYS = {"title", "additionalProperties", "$defs"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline `$ref`s and rewrite JSON-schema idioms into Kubernetes structural-schema ones."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _resolve({**target, **extra}, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        nullable = len(options) < len(node["anyOf"])
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf {node['anyOf']!r} as a structural schema")
        merged = {**{k: v for k, v in node.items() if k != "anyOf"}, **options[0]}
        out = _resolve(merged, defs)
        if nullable:
            out["nullable"] = True
        return out
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS:
            continue
        if key == "default" and value is None:
            continue
        if key == "exclusiveMinimum":
            out["minimum"] = value
            out["exclusiveMinimum"] = True
            continue
        if key == "exclusiveMaximum":
            out["maximum"] = value
            out["exclusiveMaximum"] = True
            continue
        if key == "properties":
            out[key] = {name: _resolve(prop, defs) for name, prop in value.items()}
            continue
        out[key] = _resolve(value, defs)
    # Maps (nodeSelector): keep the value type, which pydantic writes as additionalProperties.
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _resolve(node["additionalProperties"], defs)
    # Objects that pydantic fills with a default_factory: default them to {} so that the API server
    # applies the nested defaults too (structural defaulting recurses into defaulted objects).
    if out.get("type") == "object" and "properties" in out:
        for name, prop in out["properties"].items():
            defaultable = (
                prop.get("type") == "object"
                and "properties" in prop
                and "default" not in prop
                and not prop.get("required")
                and not prop.get("nullable")
            )
            if defaultable and name not in out.get("required", []):
                prop["default"] = {}
    return out


def spec_schema(model: type[BaseModel], kind: str) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of `spec` for `kind`, with its CEL rules attached."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    schema = _resolve(raw, raw.get("$defs", {}))
    for path, rules in _CEL_RULES.get(kind, {}).items():
        node = schema
        for part in path:
            node = node["properties"][part]
        node["x-kubernetes-validations"] = copy.deepcopy(rules)
    return schema


def _conditions_schema() -> dict[str, Any]:
    return {
        "type": "array",
        "description": "AdapterReady, BackboneReady, Ready (LoRAFunction); GPUsSelected, Ready (Backbone)",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "type": "object",
            "required": ["type", "status"],
            "properties": {
                "type": {"type": "string"},
                "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                "reason": {"type": "string"},
                "message": {"type": "string"},
                "lastTransitionTime": {"type": "string", "format": "date-time"},
                "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
            },
        },
    }


def _backbone_status_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "phase": {"type": "string", "enum": ["Pending", "Loading", "Ready", "Failed"]},
            "observedGeneration": {"type": "integer", "format": "int64"},
            "numGPUs": {"type": "integer", "description": "GPUs selected to hold a copy"},
            "readyGPUs": {"type": "integer", "description": "GPUs whose backbone server is ready"},
            "gpus": {
                "type": "array",
                "description": "the GPUs that hold (or will hold) a copy, with their memory",
                "items": {
                    "type": "object",
                    "properties": {
                        "slot": {"type": "string", "description": "stable id of (node, GPU index)"},
                        "node": {"type": "string"},
                        "index": {"type": "integer"},
                        "uuid": {"type": "string"},
                        "product": {"type": "string"},
                        "memoryMiB": {"type": "integer"},
                        "server": {"type": "string", "description": "backbone-server pod"},
                        "resourceClaim": {"type": "string"},
                        "ready": {"type": "boolean"},
                        "standbyWorkers": {"type": "integer"},
                        "readyStandbyWorkers": {"type": "integer"},
                    },
                },
            },
            "conditions": _conditions_schema(),
        },
    }


def _function_status_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "phase": {
                "type": "string",
                "enum": ["Pending", "Idle", "Scaling", "Ready", "Failed", "Terminating"],
            },
            "observedGeneration": {"type": "integer", "format": "int64"},
            "replicas": {"type": "integer", "description": "bound worker pods that exist"},
            "readyReplicas": {"type": "integer", "description": "bound worker pods that are ready"},
            "desiredReplicas": {"type": "integer", "description": "what the controller asks, clamped"},
            "endpoint": {"type": "string", "description": "HTTP URL of the native invoke endpoint"},
            "lastColdStartMs": {"type": "integer", "nullable": True},
            "adapter": {
                "type": "object",
                "description": "the adapter shape read off adapter_config.json and the safetensors header",
                "properties": {
                    "rank": {"type": "integer"},
                    "alpha": {"type": "number"},
                    "targetModules": {"type": "array", "items": {"type": "string"}},
                    "dtype": {"type": "string"},
                    "numTensors": {"type": "integer"},
                    "path": {"type": "string"},
                },
            },
            "conditions": _conditions_schema(),
        },
    }


def build_backbone_crd() -> dict[str, Any]:
    return _crd(
        kind="Backbone",
        plural="backbones",
        short_names=["bb"],
        scope="Cluster",
        spec=spec_schema(BackboneSpec, "Backbone"),
        status=_backbone_status_schema(),
        columns=[
            {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri"},
            {"name": "Dtype", "type": "string", "jsonPath": ".spec.dtype", "priority": 1},
            {"name": "GPUs", "type": "integer", "jsonPath": ".status.numGPUs"},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyGPUs"},
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    )


def build_lorafunction_crd() -> dict[str, Any]:
    return _crd(
        kind="LoRAFunction",
        plural="lorafunctions",
        short_names=["lfn", "lorafn"],
        scope="Namespaced",
        spec=spec_schema(LoRAFunctionSpec, "LoRAFunction"),
        status=_function_status_schema(),
        columns=[
            {"name": "Backbone", "type": "string", "jsonPath": ".spec.backbone"},
            {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    )


def _crd(
    *,
    kind: str,
    plural: str,
    short_names: list[str],
    scope: str,
    spec: dict[str, Any],
    status: dict[str, Any],
    columns: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "lorafn", "app.kubernetes.io/part-of": "lorafn"},
        },
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short_names,
                "categories": ["lorafn"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": spec.get("description", kind),
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


def build_crds() -> list[dict[str, Any]]:
    return [build_backbone_crd(), build_lorafunction_crd()]


def render_yaml(crd: dict[str, Any]) -> str:
    import yaml

    header = "# Generated by `python -m lorafn.operator.crds` from lorafn/api/specs.py; do not edit.\n"
    return header + yaml.safe_dump(crd, sort_keys=False, width=110)


def write_all(*dirs: str) -> list[str]:
    """Write `backbones.lorafn.io.yaml` and `lorafunctions.lorafn.io.yaml` into each directory."""
    from pathlib import Path

    written = []
    for directory in dirs:
        Path(directory).mkdir(parents=True, exist_ok=True)
        for crd in build_crds():
            path = Path(directory) / f"{crd['metadata']['name']}.yaml"
            path.write_text(render_yaml(crd))
            written.append(str(path))
    return written


CRD_DIRS = ("manifests/crds", "charts/lorafn/crds")

if __name__ == "__main__":
    for path in write_all(*CRD_DIRS):
        print(path)
