"""Fixtures of the runtime's integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.runtime.engine_helpers import write_hf_model


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as transformers writes a Llama (its own safetensors and config), one per module."""
    return write_hf_model(tmp_path_factory.mktemp("llama") / "m", tiny_model_dir, "llama")
