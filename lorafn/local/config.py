"""The local platform's one typed configuration: environment (`LORAFN_*`) or a YAML file.

Key prefix, heartbeat TTL and cache root come from `lorafn.api.settings.SharedSettings`, the same
definition the gateway and the workers read.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import SettingsConfigDict

from lorafn.api.errors import format_validation_error
from lorafn.api.settings import (
    PARK_AFTER_S,
    PARKED_KEEP_ALIVE_S,
    BurstKvMiB,
    ParkAfter,
    ParkedKeepAlive,
    ScaleUpWaitFraction,
    SharedSettings,
)


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "lorafn"


DEFAULT_GPU_BATCH_KV_MIB = 16384  # docs/batch.md#kv-from-idle-memory: batch / online 0.55-0.61 on the H100


class LocalConfig(SharedSettings):
    """`lorafn up`: where state lives, which ports, which device, how workers start and stop.

    The inherited `redis_url` is not used: `lorafn up` runs its own redis-server (`redis_port`).
    """

    model_config = SettingsConfigDict(env_prefix="LORAFN_", extra="forbid")

    state_dir: Path = Field(default_factory=default_state_dir, description="Redis data, logs, sockets")
    host: str = "127.0.0.1"
    gateway_port: int = Field(default=8080, ge=0, le=65535, description="0: any free port")
    redis_port: int = Field(default=0, ge=0, le=65535, description="0: any free port")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    share_backbone: bool = Field(
        default=True, description="one backbone server per backbone; workers map its weights read-only"
    )
    zygote: bool = Field(
        default=True, description="fork workers from a pre-imported zygote process (off: spawn each)"
    )
    worker_start_timeout_s: float = Field(default=180.0, gt=0)
    backbone_start_timeout_s: float = Field(default=600.0, gt=0)
    poll_interval_s: float = Field(default=0.2, gt=0, le=5)
    devices: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="devices the controller places workers on (default: every GPU; on CPU, 1 simulated)",
    )
    device_memory_mib: int | None = Field(
        default=None,
        ge=64,
        description="memory of each device for the controller's account (default: the GPU's; CPU: 16384)",
    )
    controller_metrics_port: int = Field(
        default=0, ge=0, le=65535, description="serve the controller's Prometheus /metrics here (0: off)"
    )
    gpu_utilization: float = Field(
        default=0.92, gt=0, le=1, description="share of a device the account grants"
    )
    warm_pool: bool = Field(
        default=True, description="keep standby workers warm (off: every cold start spawns a process)"
    )
    offloading: bool = Field(
        default=True, description="stop standby/idle workers to make room for a cold start"
    )
    # the controller's burst policy (PolicyConfig; defaults there): switches for the replay's ablations
    cold_prior_rps: float | None = Field(
        default=None, ge=0, description="rate the warm pool assumes for a never-seen function (0: off)"
    )
    max_fresh_starts_per_gpu: int | None = Field(
        default=None, ge=0, description="fresh worker starts at once per device (0: no cap)"
    )
    thrash_horizon_starts: float | None = Field(
        default=None, ge=0, description="offloading spares workers back within this many starts (0: off)"
    )
    park_idle: bool = Field(
        default=True,
        description="park idle bound workers under memory pressure (release their KV cache, keep the "
        "process) before stopping any (the controller's PolicyConfig.park_idle; on since the H100 replay, "
        "docs/benchmarks.md)",
    )
    parked_keep_alive_s: ParkedKeepAlive = PARKED_KEEP_ALIVE_S

    park_after_s: ParkAfter = PARK_AFTER_S
    batch_kv_mib: int | None = Field(
        default=None,
        ge=0,
        description="the KV budget (MiB) a bound worker of a function with an offline batch backlog grows "
        "to, out of GPU memory nothing else wants (keeping room for one more standby); back to its "
        "function's budget once the batch is done; 0: off; default: 16384 on a GPU (batch / online "
        "makespan 0.55-0.61 on the H100), 0 on CPU (PolicyConfig.batch_kv_bytes, docs/batch.md)",
    )
    burst_kv_mib: BurstKvMiB = 0
    scale_up_wait_fraction: ScaleUpWaitFraction = None
    # the warm pool's starts on this machine (PolicyConfig.max_pool_starts_per_node / pool_waits_for_demand)
    pool_starts_at_once: int | None = Field(
        default=None,
        ge=0,
        description="standby starts under way at once on this machine (default: on CPU what its cores "
        "warm at once, cores // a worker's threads; on GPU no limit; 0: no limit)",
    )
    pool_waits_for_demand: bool | None = Field(
        default=None,
        description="no standby starts while a request waits for its function's first worker (default: on "
        "CPU, where a warm-up takes the cores that worker's first prefill needs)",
    )
    preload_claims: bool = Field(
        default=True,
        description="a standby holding a function's pre-loaded adapter takes that function's first request "
        "itself (off: it waits for the controller's bind)",
    )
    gpu_admission: bool = Field(
        default=False,
        description="workers of a device take turns for prefills by deadline margin (opt-in: on the H100 "
        "trace replay it raised TTFT p50 from 1.0 s to 14.7 s; docs/benchmarks.md)",
    )
    worker_overhead_mib: int | None = Field(
        default=None,
        ge=0,
        description="a worker's memory besides KV and LoRA (default: measured per device kind)",
    )
    default_kv_mib: int | None = Field(
        default=None,
        ge=1,
        description="KV budget of a function without spec.resources (default per device kind)",
    )

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        has_gpu = shutil.which("nvidia-smi") is not None and Path("/dev/nvidia0").exists()
        return "cuda" if has_gpu else "cpu"

    def batch_kv_bytes(self, device: str) -> int:
        """KV lent to an offline batch's worker (`PolicyConfig.batch_kv_bytes`, docs/batch.md#kv-from-idle-
        memory): `batch_kv_mib` where set, else 16 GiB on a GPU (measured on the H100) and none on CPU (the
        "device" there is host memory the OS shares with everything else)."""
        if self.batch_kv_mib is not None:
            return self.batch_kv_mib << 20
        return DEFAULT_GPU_BATCH_KV_MIB << 20 if device == "cuda" else 0

    def pool_start_policy(self, device: str, cores: int, worker_threads: int) -> dict[str, Any]:
        """`PolicyConfig` keyword arguments for the warm pool's starts on this machine (pure). On CPU every
        simulated device shares the host's ``cores`` and each worker computes on ``worker_threads`` of them:
        a standby's warm-up is forwards on all of them, so only ``cores // worker_threads`` (at least 1) warm
        at once, and none while a request waits for its function's first worker (on the 2-core VM, with
        OpenMP's passive wait, four warming at once took ~6 s each, 2 s alone at the time, and the demo's
        first token came after 6.2-6.6 s; with these two rules 0.8 s; docs/benchmarks.md, "The README
        demo"). On a GPU the cores are the host's, not the device's: no limit unless set.
        ``pool_starts_at_once`` 0 = no limit."""
        if cores < 1 or worker_threads < 1:
            raise ValueError(f"cores and worker_threads must be >= 1, got {cores!r} and {worker_threads!r}")
        cpu = device == "cpu"
        at_once = self.pool_starts_at_once
        if at_once is None:
            at_once = max(1, cores // worker_threads) if cpu else 0
        waits = cpu if self.pool_waits_for_demand is None else self.pool_waits_for_demand
        return {"max_pool_starts_per_node": at_once or None, "pool_waits_for_demand": waits}


def host_cores() -> int:
    """The CPUs this process may run on (its affinity mask, as a container's cpuset limits it)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def cpu_worker_threads(env: Mapping[str, str], cores: int) -> int:
    """The threads a CPU worker computes on: ``OMP_NUM_THREADS`` where the environment sets it (the zygote
    applies it to each child with torch.set_num_threads), else torch's default, one per core."""
    try:
        threads = int(env.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return cores
    return threads if threads >= 1 else cores


def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> LocalConfig:
    """Environment, then the YAML file's values, then explicit overrides (command-line options)."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ValueError(f"cannot read config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"config file {path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping of settings")
        values.update(loaded or {})
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return LocalConfig(**values)
    except ValidationError as exc:
        raise ValueError(f"invalid local config: {format_validation_error(exc, prefix='config')}") from None


class PlatformState(BaseModel):
    """What a running `lorafn up` tells the other commands (written to `<state dir>/platform.json`)."""

    pid: int
    redis_url: str
    gateway_url: str
    key_prefix: str
    device: str

    @staticmethod
    def path(state_dir: Path) -> Path:
        return state_dir / "platform.json"

    @property
    def shown_redis_url(self) -> str:
        """`redis_url` without its password, for printing."""
        parts = urlsplit(self.redis_url)
        if parts.password is None:
            return self.redis_url
        netloc = f":***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))

    def write(self, state_dir: Path) -> None:
        """platform.json, 0600 (`redis_url` carries the Redis password), in a state directory made 0700
        (it holds the Redis data, logs and secrets of the platform's user alone)."""
        os.chmod(state_dir, 0o700)
        tmp = self.path(state_dir).with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.model_dump_json(indent=2))
        os.chmod(tmp, 0o600)
        tmp.replace(self.path(state_dir))

    @classmethod
    def read(cls, state_dir: Path) -> PlatformState:
        """The running platform's state, or a ValueError telling the user to start one."""
        path = cls.path(state_dir)
        try:
            state = cls.model_validate(json.loads(path.read_text()))
        except FileNotFoundError:
            raise ValueError(
                f"no local platform is running (no {path}); start one with `lorafn up`"
            ) from None
        except (ValueError, ValidationError):
            raise ValueError(f"{path} is damaged; stop any `lorafn up` and start it again") from None
        try:
            os.kill(state.pid, 0)
        except ProcessLookupError:
            raise ValueError(
                f"the local platform (pid {state.pid}) is not running any more; start it with `lorafn up`"
            ) from None
        except PermissionError:
            pass
        return state
