"""Validate a custom resource the way the API server does with our CRDs: structural defaults, the
OpenAPI v3 schema (as JSON schema, draft 4 semantics: boolean exclusiveMinimum, `nullable`), unknown
fields refused (kubectl's strict field validation), then the `x-kubernetes-validations` CEL rules,
evaluated with a real CEL implementation (cel-python)."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema

from lorafn.operator.crds import build_crds


class Rejected(ValueError):
    pass


def _crd_for(obj: dict[str, Any]) -> dict[str, Any]:
    for crd in build_crds():
        names = crd["spec"]["names"]
        version = crd["spec"]["versions"][0]["name"]
        if obj.get("kind") == names["kind"]:
            if obj.get("apiVersion") != f"{crd['spec']['group']}/{version}":
                raise Rejected(f"apiVersion {obj.get('apiVersion')!r} is not served")
            return crd
    raise Rejected(f"no CRD for kind {obj.get('kind')!r}")


def to_json_schema(node: Any) -> Any:
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {
        k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"
    }
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    for name, prop in (schema.get("properties") or {}).items():
        if name not in value and "default" in prop:
            value[name] = copy.deepcopy(prop["default"])
        if name in value:
            value[name] = apply_defaults(prop, value[name])
    return value


def _cel_rules(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    problems = []
    for rule in schema.get("x-kubernetes-validations") or []:
        env = celpy.Environment()
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(value)})):
            problems.append(f"{path}: {rule['message']}")
    if isinstance(value, dict):
        for name, prop in (schema.get("properties") or {}).items():
            if name in value:
                problems += _cel_rules(prop, value[name], f"{path}.{name}")
    return problems


def validate_custom_resource(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as stored (defaults applied), or Rejected with the reasons."""
    crd = _crd_for(obj)
    meta = obj.get("metadata") or {}
    if crd["spec"]["scope"] == "Cluster" and "namespace" in meta:
        raise Rejected("a cluster-scoped object has no metadata.namespace")
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    stored = apply_defaults(schema, copy.deepcopy(obj))
    validator = jsonschema.Draft4Validator(to_json_schema(schema))
    errors = sorted(validator.iter_errors(stored), key=lambda e: list(e.absolute_path))
    if errors:
        raise Rejected("; ".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors))
    problems = _cel_rules(schema["properties"]["spec"], stored["spec"], "spec")
    if problems:
        raise Rejected("; ".join(problems))
    return stored
