"""GPU test fixtures: the llama-2-7b random preset, written once per session (about 13.5 GB); point
LORAFN_LLAMA2_7B_DIR at an existing copy (`lorafn model random --preset llama-2-7b --dtype bfloat16 --out
DIR --seed 0`) to skip that."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def llama7b_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("LORAFN_LLAMA2_7B_DIR")
    if env:
        return Path(env)
    from lorafn.models.random_model import write_random_model

    return write_random_model(
        "llama-2-7b", tmp_path_factory.mktemp("m") / "llama-2-7b", seed=0, dtype="bfloat16", progress=False
    )
