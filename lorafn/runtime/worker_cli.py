"""`lorafn worker serve`: one worker process bound to one function (started by `lorafn up` or a pod).

Configuration: `WorkerSettings` (environment variables `LORAFN_*`; command-line options override).
The model and adapter directories default to the function's registration in Redis.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import typer
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

app = typer.Typer(help="Run a worker: the serving loop of one function.", no_args_is_help=True)


class WorkerSettings(BaseSettings):
    """A worker's configuration (env prefix `LORAFN_`, e.g. `LORAFN_REDIS_URL`)."""

    model_config = SettingsConfigDict(env_prefix="LORAFN_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "lorafn"
    function: str = Field(default="", description="namespace/name of the function to serve")
    worker_id: str | None = None
    model: str | None = Field(default=None, description="backbone model dir (default: the registration's)")
    adapter: str | None = Field(default=None, description="adapter dir (default: the registration's)")
    device: str = "cpu"
    dtype: str = "auto"
    max_running: int = Field(default=64, ge=1)
    keep_alive_seconds: float | None = Field(
        default=None, ge=0, description="exit after this long idle (default: spec.scaling.keepAliveSeconds)"
    )
    heartbeat_s: float = Field(default=1.0, gt=0)
    heartbeat_ttl_s: float = Field(default=5.0, gt=0)
    claim_min_idle_ms: int = Field(default=2000, ge=0)
    engine_factory: str | None = Field(
        default=None,
        description="module:callable(settings, record) -> ServingEngine, instead of lorafn.runtime.Engine "
        "(tests and the gateway benchmark use it for their fake engines)",
    )
    backbone_socket: str | None = Field(
        default=None,
        description="Unix socket of the backbone server: map its weights read-only instead of loading them",
    )
    log_level: str = "INFO"


def default_engine(settings: WorkerSettings, record: Any) -> Any:
    """The real engine: `lorafn.runtime.Engine` on the function's backbone and adapter."""
    from lorafn.runtime import Engine, EngineConfig
    from lorafn.runtime.serving import EngineAdapter

    model = settings.model or (record.model_dir if record else "")
    adapter = settings.adapter or (record.adapter_dir if record else "") or None
    if not model:
        raise ValueError(f"no model directory for {settings.function}: register the function or pass --model")
    weight_source = None
    if settings.backbone_socket:
        # The backbone server's copy, mapped read-only: this worker holds no weight bytes of its own.
        from lorafn.backbone_server.client import SharedWeightSource

        weight_source = SharedWeightSource(settings.backbone_socket, device=settings.device)
    return EngineAdapter(
        Engine(
            EngineConfig(
                model=model,
                adapter=adapter,
                device=settings.device,
                dtype=settings.dtype,
                max_num_seqs=settings.max_running,
                weight_source=weight_source,
            )
        )
    )


def _load_factory(path: str) -> Any:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"engine_factory {path!r} must be module:callable")
    return getattr(importlib.import_module(module), attr)


def serve_worker(settings: WorkerSettings) -> int:
    """Build the engine, then run the serving loop until drained, idle or stopped; the exit code."""
    from lorafn.api import FunctionRef, LoRAFunctionSpec
    from lorafn.runtime.serving import ServingConfig, Worker, default_worker_id
    from lorafn.store import Keys, Store
    from lorafn.store.registry import get_function

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    function = str(FunctionRef.parse(settings.function))
    keys = Keys(settings.key_prefix)
    store = Store(settings.redis_url)
    record = store.run(get_function(keys, function))
    keep_alive = settings.keep_alive_seconds
    if keep_alive is None and record is not None and record.spec:
        keep_alive = float(LoRAFunctionSpec.model_validate(record.spec).scaling.keep_alive_seconds)
    factory = _load_factory(settings.engine_factory) if settings.engine_factory else default_engine
    engine = factory(settings, record)
    worker = Worker(
        store,
        keys,
        engine,
        ServingConfig(
            function=function,
            worker_id=settings.worker_id or default_worker_id(),
            max_running=settings.max_running,
            heartbeat_s=settings.heartbeat_s,
            heartbeat_ttl_s=settings.heartbeat_ttl_s,
            claim_min_idle_ms=settings.claim_min_idle_ms,
            keep_alive_s=keep_alive,
        ),
    )
    worker.install_signal_handlers()
    logging.getLogger("lorafn.worker").info("worker %s serving %s", worker.worker_id, function)
    return worker.run()


@app.command("serve")
def serve(
    function: str = typer.Option(None, "--function", "-f", help="namespace/name (env LORAFN_FUNCTION)"),
    redis_url: str = typer.Option(None, "--redis-url", help="env LORAFN_REDIS_URL"),
    model: str = typer.Option(None, "--model", help="backbone model dir (default: from the registry)"),
    adapter: str = typer.Option(None, "--adapter", help="adapter dir (default: from the registry)"),
    device: str = typer.Option(None, "--device", help="cpu | cuda | cuda:N"),
    worker_id: str = typer.Option(None, "--worker-id"),
    keep_alive_seconds: float = typer.Option(None, "--keep-alive-seconds"),
    engine_factory: str = typer.Option(None, "--engine-factory", help="module:callable (tests, benchmarks)"),
) -> None:
    """Serve one function: read its request stream, run the engine, stream replies; SIGTERM drains."""
    overrides = {k: v for k, v in locals().items() if v is not None}
    try:
        settings = WorkerSettings(**overrides)
        if not settings.function:
            raise ValueError("--function (or LORAFN_FUNCTION) is required")
        code = serve_worker(settings)
    except ValueError as e:
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=2) from None
    raise typer.Exit(code=code)
