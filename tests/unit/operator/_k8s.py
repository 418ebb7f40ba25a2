"""Validation of built objects with kubernetes-validate (the API server's own OpenAPI schemas)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate

# 1.30 is the oldest release we support; DRA's resource.k8s.io/v1 needs 1.34.
VERSIONS = ("1.30.0", "1.34.0")


def validate(obj: dict[str, Any]) -> None:
    dra = obj.get("apiVersion", "").startswith("resource.k8s.io/") or "resourceClaims" in obj.get("spec", {})
    versions = ("1.34.0",) if dra else VERSIONS
    for version in versions:
        kubernetes_validate.validate(obj, version, strict=True)
