"""Shared test configuration: the `gpu` marker skips where CUDA is absent, `cluster` without a kubeconfig."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = _cuda_available()
    has_cluster = bool(os.environ.get("KUBECONFIG")) or (Path.home() / ".kube" / "config").exists()
    skip_gpu = pytest.mark.skip(reason="needs CUDA; none on this machine")
    skip_cluster = pytest.mark.skip(reason="needs a Kubernetes cluster; no kubeconfig here")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "cluster" in item.keywords and not has_cluster:
            item.add_marker(skip_cluster)


# --- model assets (lorafn.runtime.assets) -------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random `tiny` Llama (seed 0, float32): config, safetensors shards, tokenizer; written once a run."""
    from lorafn.runtime.assets.random_model import write_random_model

    return write_random_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0, progress=False)
