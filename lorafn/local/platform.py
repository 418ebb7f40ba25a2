"""`lorafn up`: the whole platform on one machine, as real processes.

redis-server, one backbone server per registered backbone (weights loaded once, mapped read-only by
every worker), the gateway, and workers started on demand. The supervisor loop here is the local
stand-in for the operator + controller: it reads the gateway's cold-start demand from Redis, starts a
worker for the function (up to `maxReplicas`), keeps `minReplicas` running, and lets idle workers exit
after `keepAliveSeconds` (they exit by themselves; a fresh one starts on the next demand).
"""

from __future__ import annotations

import logging
import os
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from lorafn.api import LoRAFunctionSpec
from lorafn.local.config import LocalConfig, PlatformState
from lorafn.local.procs import Child, ProcessGroup, lorafn_argv
from lorafn.local.redis_proc import RedisProcess, free_port
from lorafn.store import Keys, Store
from lorafn.store.backbones import get_backbone, list_backbones
from lorafn.store.registry import get_function, list_functions
from lorafn.store.streams import read_demand
from lorafn.store.workers import server_time_ms

log = logging.getLogger("lorafn.up")


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return 200 <= reply.status < 300
    except OSError:
        return False


@dataclass
class FunctionWorkers:
    """Worker processes of one function that this supervisor started (names `worker/<fn>/<n>`)."""

    names: list[str] = field(default_factory=list)
    next_index: int = 0


class LocalPlatform:
    def __init__(self, config: LocalConfig) -> None:
        self.config = config
        self.state_dir = config.state_dir
        self.device = config.resolved_device()
        self.keys = Keys(config.key_prefix)
        self.procs = ProcessGroup(self.state_dir / "logs")
        self.redis = RedisProcess(data_dir=self.state_dir / "redis", port=config.redis_port)
        self.store: Store | None = None
        self.gateway_url = ""
        self.backbone_sockets: dict[str, Path] = {}
        self.workers: dict[str, FunctionWorkers] = {}
        self._demand_cursor = "$"

    # -- start and stop --------------------------------------------------------------------------
    def start(self) -> PlatformState:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "sockets").mkdir(exist_ok=True)
        log.info("starting redis-server (data in %s)", self.redis.data_dir)
        self.redis.start()
        self.store = Store(self.redis.url)
        # Demand recorded before this start (a previous run's) is stale: read entries after now only.
        self._demand_cursor = f"{self.store.run(server_time_ms())}-0"
        self._start_gateway()
        state = PlatformState(
            pid=os.getpid(),
            redis_url=self.redis.url,
            gateway_url=self.gateway_url,
            key_prefix=self.config.key_prefix,
            device=self.device,
        )
        state.write(self.state_dir)
        self.sync_backbones()
        return state

    def _component_env(self) -> dict[str, str]:
        return {"LORAFN_REDIS_URL": self.redis.url, "LORAFN_KEY_PREFIX": self.config.key_prefix}

    def _start_gateway(self) -> None:
        # A restarted gateway keeps the port it had, so platform.json and clients stay right.
        port = (
            int(self.gateway_url.rsplit(":", 1)[1])
            if self.gateway_url
            else self.config.gateway_port or free_port(self.config.host)
        )
        self.gateway_url = f"http://{self.config.host}:{port}"
        child = self.procs.start(
            "gateway",
            lorafn_argv("gateway", "serve", "--host", self.config.host, "--port", str(port)),
            env=self._component_env(),
        )
        self.procs.wait_until(child, lambda: http_ok(f"{self.gateway_url}/readyz"), timeout_s=60)
        log.info("gateway ready at %s", self.gateway_url)

    def stop(self) -> None:
        """Workers drain first, then the gateway and backbone servers, then Redis."""
        log.info("stopping: workers, gateway, backbone servers, redis")
        self.procs.stop_all(order=("worker/", "gateway", "backbone/"), timeout_s=15)
        if self.store is not None:
            self.store.close()
        self.redis.stop()
        PlatformState.path(self.state_dir).unlink(missing_ok=True)

    # -- backbones ---------------------------------------------------------------------------------
    def sync_backbones(self) -> None:
        """Start a backbone server for each registered backbone that has none (shared-weights mode)."""
        if not self.config.share_backbone:
            return
        assert self.store is not None
        for name in self.store.run(list_backbones(self.keys)):
            proc_name = f"backbone/{name}"
            if proc_name in self.procs.children and self.procs.children[proc_name].alive():
                continue
            record = self.store.run(get_backbone(self.keys, name))
            if record is None:
                continue
            socket_path = self.state_dir / "sockets" / f"{name}.sock"
            socket_path.unlink(missing_ok=True)
            log.info("loading backbone %s from %s on %s", name, record.model_dir, self.device)
            child = self.procs.start(
                proc_name,
                lorafn_argv(
                    "backbone-server", "serve", "--model", record.model_dir, "--socket", str(socket_path),
                    "--device", self.device,
                ),
            )  # fmt: skip
            self.procs.wait_until(
                child, socket_path.exists, timeout_s=self.config.backbone_start_timeout_s, poll_s=0.2
            )
            self.backbone_sockets[name] = socket_path
            log.info("backbone %s ready (socket %s)", name, socket_path)

    # -- workers -----------------------------------------------------------------------------------
    def start_worker(self, function: str) -> Child | None:
        assert self.store is not None
        record = self.store.run(get_function(self.keys, function))
        if record is None:
            log.warning("demand for unknown function %s ignored", function)
            return None
        spec = LoRAFunctionSpec.model_validate(record.spec)
        tracked = self.workers.setdefault(function, FunctionWorkers())
        if len(tracked.names) >= spec.scaling.max_replicas:
            return None
        name = f"worker/{function}/{tracked.next_index}"
        worker_id = f"{function.replace('/', '.')}.{tracked.next_index}.{int(time.time())}"
        tracked.next_index += 1
        env = self._component_env()
        socket_path = self.backbone_sockets.get(spec.backbone)
        if socket_path is not None:
            env["LORAFN_BACKBONE_SOCKET"] = str(socket_path)
        argv = lorafn_argv(
            "worker", "serve", "--function", function, "--device", self.device, "--worker-id", worker_id
        )
        child = self.procs.start(name, argv, env=env)
        tracked.names.append(name)
        log.info("cold start: worker %s for %s (pid %d)", worker_id, function, child.pid)
        return child

    def _reap(self) -> None:
        for child in self.procs.reap():
            code = child.exit_code()
            if child.name.startswith("worker/"):
                function = child.name.split("/", 1)[1].rsplit("/", 1)[0]
                tracked = self.workers.get(function)
                if tracked and child.name in tracked.names:
                    tracked.names.remove(child.name)
                if code == 0:
                    log.info("worker %s exited (idle past keep-alive or drained)", child.name)
                else:
                    log.error(
                        "worker %s died with code %s; log tail:\n%s", child.name, code, child.log_tail()
                    )
            elif child.name == "gateway":
                log.error("the gateway died (code %s); restarting it. Log tail:\n%s", code, child.log_tail())
                self._start_gateway()
            elif child.name.startswith("backbone/"):
                log.error("backbone server %s died (code %s):\n%s", child.name, code, child.log_tail())
                self.backbone_sockets.pop(child.name.split("/", 1)[1], None)

    def _keep_min_replicas(self) -> None:
        assert self.store is not None
        for function in self.store.run(list_functions(self.keys)):
            record = self.store.run(get_function(self.keys, function))
            if record is None:
                continue
            spec = LoRAFunctionSpec.model_validate(record.spec)
            running = len(self.workers.get(function, FunctionWorkers()).names)
            for _ in range(max(0, spec.scaling.min_replicas - running)):
                self.start_worker(function)

    def tick(self, block_ms: int) -> None:
        """One supervisor iteration: reap, start backbones, answer demand, keep minReplicas."""
        assert self.store is not None
        self._reap()
        self.sync_backbones()
        for _entry_id, fields in self.store.run(read_demand(self.keys, self._demand_cursor, block_ms)):
            self._demand_cursor = _entry_id
            function = fields.get("function", "")
            if not function:
                continue
            # Demand means a request found no live worker. One that this supervisor already started
            # may still be loading: start another only when none is tracked for the function.
            if not self.workers.get(function, FunctionWorkers()).names:
                self.start_worker(function)
        self._keep_min_replicas()

    def serve_forever(self, stop_after_s: float | None = None) -> None:
        deadline = None if stop_after_s is None else time.monotonic() + stop_after_s
        block_ms = int(self.config.poll_interval_s * 1000)
        while deadline is None or time.monotonic() < deadline:
            self.tick(block_ms)
