"""Fixtures of the runtime's integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.runtime.engine_helpers import write_hf_model
from tests.integration.runtime.interpreted import ModelChecks, selected_model_checks
from tests.unit.runtime.interpreted import require_triton


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as transformers writes a Llama (its own safetensors and config), one per module."""
    return write_hf_model(tmp_path_factory.mktemp("llama") / "m", tiny_model_dir, "llama")


@pytest.fixture(scope="session")
def model_checks(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ModelChecks]:
    """The interpreted model checks of every selected test that declares one (its module's MODEL_CHECKS),
    started together when the first of those tests asks (interpreted.py's module doc)."""
    require_triton()
    checks = ModelChecks(lambda name: tmp_path_factory.mktemp(name[:40]), tiny_model_dir)
    checks.start(selected_model_checks(request.session.items))
    yield checks
    checks.close()
