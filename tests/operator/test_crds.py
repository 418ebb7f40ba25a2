"""The CRDs: generated from the pydantic specs, valid CRD objects, agreeing with pydantic on samples."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from lorafn.api import BackboneSpec, LoRAFunctionSpec
from lorafn.local.manifests import parse_manifest
from lorafn.operator.crds import build_crds
from tests.operator.crd_validation import Rejected, validate_custom_resource

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "manifests" / "samples"
INVALID = sorted((SAMPLES / "invalid").glob("*.yaml"))


def test_generated_files_are_up_to_date() -> None:
    """CRDs, the chart README's values table and manifests/install.yaml match their sources."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "render_manifests.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
def test_crds_are_valid_kubernetes_objects(version: str) -> None:
    for crd in build_crds():
        kubernetes_validate.validate(crd, version, strict=True)


def test_crd_shape() -> None:
    backbone, function = build_crds()
    assert backbone["spec"]["scope"] == "Cluster" and function["spec"]["scope"] == "Namespaced"
    assert (
        "bb" in backbone["spec"]["names"]["shortNames"] and "lfn" in function["spec"]["names"]["shortNames"]
    )
    version = function["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert {"Backbone", "Replicas", "Ready", "Endpoint", "Age"} <= set(columns)
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["backbone", "adapter"]
    assert spec["properties"]["scaling"]["properties"]["minReplicas"]["minimum"] == 0
    assert spec["properties"]["scaling"]["x-kubernetes-validations"]
    text = yaml.safe_dump(build_crds())
    assert "$ref" not in text and "anyOf" not in text and "title" not in text


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pydantic(obj: dict[str, Any]) -> None:
    model = BackboneSpec if obj["kind"] == "Backbone" else LoRAFunctionSpec
    model.model_validate(obj["spec"])


def test_samples_are_admitted_and_parse_everywhere() -> None:
    docs = [d for p in sorted(SAMPLES.glob("*.yaml")) for d in _docs(p)]
    custom = [d for d in docs if d["apiVersion"].startswith("lorafn.io/")]
    assert {d["kind"] for d in custom} == {"Backbone", "LoRAFunction"}
    for doc in custom:
        stored = validate_custom_resource(doc)
        _pydantic(stored)  # what the API server stores, the operator accepts
    for doc in docs:
        if not doc["apiVersion"].startswith("lorafn.io/"):
            kubernetes_validate.validate(doc, "1.30.0", strict=True)
    # `lorafn apply -f` reads the same files.
    text = "\n---\n".join(
        p.read_text() for p in sorted(SAMPLES.glob("*.yaml")) if "Namespace" not in p.read_text()
    )
    manifest = parse_manifest(text)
    assert [f.ref.name for f in manifest.functions] == ["french"]


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_samples_are_rejected_where_they_say(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# rejected-by: ")
    (doc,) = _docs(path)
    with pytest.raises(ValidationError):
        _pydantic(doc)  # pydantic refuses every one of them
    if first.startswith("# rejected-by: crd"):
        with pytest.raises(Rejected):
            validate_custom_resource(doc)
    else:
        validate_custom_resource(doc)  # admitted; the operator's condition reason is checked elsewhere
        assert first.split()[3] in {"UnsupportedURIScheme", "InvalidURI", "InvalidSpec"}


@pytest.mark.parametrize(
    "spec",
    [
        {"scaling": {"minReplicas": 3}},  # max defaults to 1: both refuse
        {"scaling": {"minReplicas": 2, "maxReplicas": 2}},
        {"slo": {"ttftMs": 0}},
        {"slo": {"tpotMs": None}},
        {"generation": {"topP": 0.0}},
        {"generation": {"topP": 1.0, "topK": -1}},
        {"generation": {"stop": ["x"] * 17}},
        {"auth": {"apiKeySecretRef": {"name": "keys"}}},
        {"auth": {"apiKeySecretRef": {"key": "k"}}},
        {"auth": {"apiKeySecretRef": {"name": "Keys!"}}},
        {"backbone": "x" * 64},
    ],
)
def test_crd_and_pydantic_agree(spec: dict[str, Any]) -> None:
    body = {"backbone": "smollm2-135m", "adapter": {"uri": "file:///a"}, **spec}
    obj = {
        "apiVersion": "lorafn.io/v1alpha1",
        "kind": "LoRAFunction",
        "metadata": {"name": "f", "namespace": "n"},
        "spec": body,
    }
    try:
        LoRAFunctionSpec.model_validate(body)
        pydantic_ok = True
    except ValidationError:
        pydantic_ok = False
    try:
        validate_custom_resource(obj)
        crd_ok = True
    except Rejected:
        crd_ok = False
    assert crd_ok == pydantic_ok, (spec, crd_ok, pydantic_ok)


def test_backbone_defaults_match_pydantic() -> None:
    obj = {
        "apiVersion": "lorafn.io/v1alpha1",
        "kind": "Backbone",
        "metadata": {"name": "b"},
        "spec": {"model": {"uri": "file:///m"}},
    }
    stored = validate_custom_resource(obj)
    assert stored["spec"]["dtype"] == "bfloat16" and stored["spec"]["warmPool"] == {
        "minStandby": 1,
        "maxStandby": 4,
    }
    assert BackboneSpec.model_validate(stored["spec"]) == BackboneSpec.model_validate(obj["spec"])
