"""`WorkerSettings` inherits what components must agree on from `SharedSettings`; its CLI options keep
overriding the environment."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from lorafn.api.settings import SharedSettings, token_buckets
from lorafn.cli import app
from lorafn.runtime import worker
from lorafn.runtime.worker import WorkerSettings


def test_shared_fields_come_from_the_shared_base(monkeypatch: pytest.MonkeyPatch) -> None:
    assert issubclass(WorkerSettings, SharedSettings)
    own = set(WorkerSettings.model_fields) - set(SharedSettings.model_fields)
    assert not own & {"redis_url", "key_prefix", "heartbeat_ttl_s", "cache_dir"}
    monkeypatch.setenv("LORAFN_HEARTBEAT_TTL_S", "7.5")
    monkeypatch.setenv("LORAFN_KEY_PREFIX", "blue")
    monkeypatch.setenv("LORAFN_FUNCTION", "team-a/fn")
    s = WorkerSettings()
    assert (s.heartbeat_ttl_s, s.key_prefix, s.function) == (7.5, "blue", "team-a/fn")


def test_cli_options_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[WorkerSettings] = []
    monkeypatch.setattr(worker, "serve_worker", lambda settings: seen.append(settings) or 0)
    monkeypatch.setenv("LORAFN_REDIS_URL", "redis://env:1/0")
    monkeypatch.setenv("LORAFN_FUNCTION", "team-a/env")
    res = CliRunner().invoke(
        app,
        [
            "worker",
            "serve",
            "--function",
            "team-a/cli",
            "--redis-url",
            "redis://cli:2/0",
            "--keep-alive-seconds",
            "3",
        ],
    )
    assert res.exit_code == 0, res.output
    (s,) = seen
    assert (s.function, s.redis_url, s.keep_alive_seconds) == ("team-a/cli", "redis://cli:2/0", 3.0)


def test_serve_without_a_function_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAFN_FUNCTION", raising=False)
    res = CliRunner().invoke(app, ["worker", "serve", "--redis-url", "redis://x:1/0"])
    assert res.exit_code == 2
    assert "--function (or LORAFN_FUNCTION) is required" in res.output


def test_the_cublas_workspace_is_torchs_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    assert WorkerSettings().cublas_workspace_kib is None
    assert worker.cublas_workspace_env(WorkerSettings().cublas_workspace_kib) == {}
    assert worker.cublas_workspace_env(1024) == {
        "CUBLAS_WORKSPACE_CONFIG": ":1024:1",
        "CUBLASLT_WORKSPACE_SIZE": "1024",
    }
    assert worker.cublas_workspace_env(None) == {}  # torch's own default
    monkeypatch.setenv("LORAFN_CUBLAS_WORKSPACE_KIB", "0")
    assert (
        worker.cublas_workspace_env(WorkerSettings().cublas_workspace_kib)["CUBLAS_WORKSPACE_CONFIG"]
        == ":0:1"
    )
    with pytest.raises(ValueError, match="cublas_workspace_kib"):
        worker.cublas_workspace_env(-1)


def test_a_gpu_worker_asks_for_one_cuda_connection_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    assert WorkerSettings().cuda_max_connections == 1
    assert worker.worker_cuda_env(None, 1) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert worker.worker_cuda_env(1024, None) == worker.cublas_workspace_env(1024)  # the driver's default
    monkeypatch.setenv("LORAFN_CUDA_MAX_CONNECTIONS", "4")
    assert WorkerSettings().cuda_max_connections == 4
    monkeypatch.setenv("LORAFN_CUDA_MAX_CONNECTIONS", "0")
    with pytest.raises(ValueError, match="cuda_max_connections"):
        WorkerSettings()


def test_prefill_graph_buckets_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from lorafn.runtime import EngineConfig

    monkeypatch.setenv("LORAFN_PREFILL_GRAPH_TOKENS", "512, 128")
    s = WorkerSettings()
    assert s.prefill_graph_tokens == "128,512"
    # what make_engine hands the engine, which bounds the buckets by its chunk size
    assert EngineConfig(model="/m", prefill_graph_tokens=token_buckets(s.prefill_graph_tokens))
    assert WorkerSettings(prefill_graph_tokens="").prefill_graph_tokens == ""
    for bad in ("128,x", "1,64"):
        with pytest.raises(ValueError, match="prefill_graph_tokens"):
            WorkerSettings(prefill_graph_tokens=bad)
