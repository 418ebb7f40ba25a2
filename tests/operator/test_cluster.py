"""Against a real API server (marked `cluster`, skipped without a kubeconfig): server-side dry runs, so
the CRDs' OpenAPI schemas and CEL rules are enforced by Kubernetes itself, and nothing is left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl", path=f"{ROOT / '.tools' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")

pytestmark = pytest.mark.cluster


def kubectl(*args: str) -> subprocess.CompletedProcess[str]:
    if KUBECTL is None:
        pytest.fail("kubectl not found: scripts/install_helm.sh installs it into .tools/bin")
    return subprocess.run([KUBECTL, *args], capture_output=True, text=True)


def test_crds_and_samples_are_accepted_by_the_api_server() -> None:
    # CRDs must exist for the samples' dry run: apply them for real (idempotent), the rest as dry runs.
    for real in ("crds", "samples/00-namespace.yaml"):
        result = kubectl("apply", "--server-side", "-f", str(ROOT / "manifests" / real))
        assert result.returncode == 0, result.stderr
    result = kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", str(ROOT / "manifests" / "install.yaml")
    )
    assert result.returncode == 0, result.stderr
    for sample in ("10-backbone.yaml", "20-function.yaml"):
        result = kubectl(
            "apply",
            "--dry-run=server",
            "--validate=strict",
            "-f",
            str(ROOT / "manifests" / "samples" / sample),
        )
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "manifests" / "samples" / "invalid").glob("*.yaml")), ids=str)
def test_invalid_samples_are_refused_by_the_api_server(path: Path) -> None:
    if "rejected-by: crd" not in path.read_text().splitlines()[0]:
        pytest.skip("admitted by the schema; the operator refuses it")
    kubectl("apply", "--server-side", "-f", str(ROOT / "manifests" / "samples" / "00-namespace.yaml"))
    result = kubectl("apply", "--dry-run=server", "--validate=strict", "-f", str(path))
    assert result.returncode != 0
    assert "spec" in result.stderr, result.stderr  # refused for its spec, not for a missing namespace
