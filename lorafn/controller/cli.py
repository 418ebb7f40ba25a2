"""`lorafn controller run`: the controller on Kubernetes (the chart's controller Deployment).

It talks to Redis only: it reads the registry, the workers' heartbeats, queues and the GPU inventory the
operator writes, and asks for pods through desired counts (`lorafn.controller.kube_executor`). One
controller acts at a time: each round starts by taking or renewing the Redis lease
(`<prefix>:controller:lease`), so a second replica (a rolling update, a stuck old pod) only waits and
takes over when the lease expires.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Literal

import typer
from pydantic import Field

from lorafn.api.settings import (
    PARK_AFTER_S,
    PARKED_KEEP_ALIVE_S,
    BurstKvMiB,
    ParkAfter,
    ParkedKeepAlive,
    ScaleUpWaitFraction,
    SharedSettings,
)
from lorafn.controller.policy.config import VictimRate

if TYPE_CHECKING:
    from lorafn.controller.driver import Controller

app = typer.Typer(help="The controller: binding, warm pool, scaling, offloading.", no_args_is_help=True)


class ControllerSettings(SharedSettings):
    """The controller's configuration (environment `LORAFN_*`; Redis URL, key prefix and heartbeat TTL
    from `SharedSettings`, so they match the workers' and the operator's)."""

    interval_s: float = Field(default=0.5, gt=0, description="seconds between decision rounds")
    lease_ttl_s: float = Field(
        default=10.0, gt=0, description="the lease lapses this long after its holder's last round"
    )
    gpu_utilization: float = Field(
        default=0.92, gt=0, le=1, description="fraction of each GPU's memory the account may grant"
    )
    worker_overhead_mib: int | None = Field(
        default=None, ge=0, description="one worker's memory besides KV and adapter (default: per device)"
    )
    default_kv_mib: int | None = Field(
        default=None, ge=1, description="KV budget of a function whose spec names none (default: per device)"
    )
    warm_pool: bool = Field(default=True, description="keep standby workers warm (pre-loading)")
    offloading: bool = Field(default=True, description="stop standby/idle workers to make room")
    preload_claims: bool = Field(
        default=True,
        description="a standby holding a function's pre-loaded adapter takes its first request itself",
    )
    # the burst policy (PolicyConfig; None keeps its default), as `lorafn up`'s config has them
    cold_prior_rps: float | None = Field(
        default=None, ge=0, description="rate the warm pool assumes for a never-seen function (0: off)"
    )
    max_fresh_starts_per_gpu: int | None = Field(
        default=None, ge=0, description="fresh worker starts at once per GPU (0: no cap)"
    )
    thrash_horizon_starts: float | None = Field(
        default=None, ge=0, description="offloading spares workers back within this many starts (0: off)"
    )
    # issue 16's account and offloading (docs/architecture.md, Controller)
    charge_own_reports: bool = Field(
        default=True,
        description="charge a bound GPU worker whose graphs are captured its own reported size (off: the "
        "largest reported overhead, as before)",
    )
    driver_headroom: float = Field(
        default=0.03, ge=0, lt=1, description="fraction of a GPU kept free of the driver's count (the guard)"
    )
    victim_rate: VictimRate = Field(
        default="long", description="arrival rate that ranks idle workers for offloading (60 s, 10 min, max)"
    )
    park_idle: bool = Field(
        default=True,
        description="park idle bound workers under memory pressure (release their KV cache, keep the "
        "process) before stopping any; on since the H100 replay (docs/architecture.md, Controller)",
    )
    parked_keep_alive_s: ParkedKeepAlive = PARKED_KEEP_ALIVE_S

    park_after_s: ParkAfter = PARK_AFTER_S
    batch_kv_mib: int = Field(
        default=0,
        ge=0,
        description="the KV budget (MiB) a bound worker of a function with an offline batch backlog grows "
        "to, out of GPU memory nothing else wants (keeping room for one more standby); back to its "
        "function's budget once the batch is done; 0: off (PolicyConfig.batch_kv_bytes, docs/batch.md)",
    )
    burst_kv_mib: BurstKvMiB = 0
    scale_up_wait_fraction: ScaleUpWaitFraction = None
    park_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="how long a park waits for the worker's answer before what it made room for waits "
        "for the next round",
    )
    device: Literal["cuda", "cpu"] = Field(default="cuda", description="the workers' device kind (sizing)")
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Prometheus /metrics port (0: off)")
    metrics_host: str = Field(default="0.0.0.0", description="address of the metrics endpoint")
    log_level: str = "INFO"


def build_controller(settings: ControllerSettings) -> Controller:
    """The driver with the Kubernetes executor, from settings (no I/O until its first round)."""
    from lorafn.api.sizing import MiB
    from lorafn.controller.driver import Controller, ControllerConfig
    from lorafn.controller.kube_executor import KubernetesExecutor
    from lorafn.controller.policy.actions import Start
    from lorafn.controller.policy.config import PolicyConfig, burst_overrides
    from lorafn.controller.snapshot import default_sizing
    from lorafn.store import Keys, Store

    sizing = default_sizing(settings.device)
    if settings.worker_overhead_mib is not None:
        sizing = dataclasses.replace(sizing, worker_overhead_bytes=settings.worker_overhead_mib * MiB)
    if settings.default_kv_mib is not None:
        sizing = dataclasses.replace(sizing, default_kv_bytes=settings.default_kv_mib * MiB)
    sizing = dataclasses.replace(sizing, charge_own_reports=settings.charge_own_reports)
    store, keys = Store(settings.redis_url, socket_timeout_s=5.0), Keys(settings.key_prefix)

    def standby_kv_bytes(action: Start) -> int:
        # the controller's reader knows the backbones and the learned overhead (called after the round's
        # snapshot, like `lorafn up`'s `_kv_budget`): a standby's KV is its grant less the rest
        return controller.reader.standby_kv_bytes(action.mem_bytes, action.shape, action.backbone)

    executor = KubernetesExecutor(store, keys, settings.heartbeat_ttl_s, standby_kv_bytes=standby_kv_bytes)
    config = ControllerConfig(
        interval_s=settings.interval_s,
        lease_ttl_s=settings.lease_ttl_s,
        heartbeat_ttl_s=settings.heartbeat_ttl_s,
        preload_claims=settings.preload_claims,
        park_timeout_s=settings.park_timeout_s,
        policy=PolicyConfig(
            gpu_utilization=settings.gpu_utilization,
            driver_headroom=settings.driver_headroom,
            victim_rate=settings.victim_rate,
            warm_pool=settings.warm_pool,
            offloading=settings.offloading,
            park_idle=settings.park_idle,
            parked_keep_alive_s=settings.parked_keep_alive_s,
            park_after_s=settings.park_after_s,
            batch_kv_bytes=settings.batch_kv_mib << 20,
            burst_kv_bytes=settings.burst_kv_mib << 20,
            scale_up_wait_fraction=settings.scale_up_wait_fraction,
            **burst_overrides(
                settings.cold_prior_rps, settings.max_fresh_starts_per_gpu, settings.thrash_horizon_starts
            ),
        ),
    )
    controller = Controller(store, keys, executor, sizing, config)
    return controller


@app.command("run")
def run(
    redis_url: str = typer.Option(None, "--redis-url", help="env LORAFN_REDIS_URL"),
    interval_s: float = typer.Option(None, "--interval-s", help="env LORAFN_INTERVAL_S"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Run the controller until interrupted (one active per deployment: the Redis lease)."""
    import logging

    overrides = {k: v for k, v in {"redis_url": redis_url, "interval_s": interval_s}.items() if v is not None}
    try:
        settings = ControllerSettings(**overrides)
    except ValueError as e:
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=2) from None
    logging.basicConfig(
        level=logging.DEBUG if verbose else settings.log_level.upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    controller = build_controller(settings)
    logging.getLogger("lorafn.controller").info(
        "controller %s: key prefix %s, device %s, a round every %.2f s (lease %.0f s)",
        controller.config.holder, settings.key_prefix, settings.device,
        settings.interval_s, settings.lease_ttl_s,
    )  # fmt: skip
    if settings.metrics_port:
        controller.metrics.serve(settings.metrics_port, settings.metrics_host)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C; SIGTERM ends it too (the lease then lapses)
        controller.serve_forever()
