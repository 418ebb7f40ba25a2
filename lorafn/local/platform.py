"""`lorafn up`: the whole platform on one machine, as real processes.

redis-server, one backbone server per registered backbone and device (weights loaded once, mapped
read-only by every worker), the gateway, and the controller (`lorafn.controller`), which decides where
workers run: it keeps a warm pool of standby workers, binds one to a function on a cold start, starts
fresh workers within each device's memory account, offloads the least valuable under pressure, and backs
off failed starts. This module only runs processes; every placement decision is the controller's.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
import urllib.request
from pathlib import Path

from lorafn.api.sizing import MiB
from lorafn.controller.driver import Controller, ControllerConfig
from lorafn.controller.policy.actions import Start
from lorafn.controller.policy.config import PolicyConfig, burst_overrides
from lorafn.controller.snapshot import SizingConfig, default_sizing
from lorafn.local.config import LocalConfig, PlatformState, cpu_worker_threads, host_cores
from lorafn.local.executor import LocalExecutor, gpu_id
from lorafn.local.lifecycle import gateway_answers
from lorafn.local.procs import ProcessGroup, lorafn_argv
from lorafn.local.redis_proc import RedisProcess, RedisWatch, free_port
from lorafn.local.zygote import ZYGOTE_NAME, ZygoteKeeper
from lorafn.store import UNAVAILABLE_ERRORS, Keys, Store
from lorafn.store.backbones import get_backbone, list_backbones

log = logging.getLogger("lorafn.up")

# a restarted redis-server replays its AOF before it answers PING
REDIS_START_TIMEOUT_S = 30.0
# rounds failing this many times in a row (not Redis outages): start a fresh controller
CONTROLLER_MAX_FAILED_ROUNDS = 5


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return 200 <= reply.status < 300
    except OSError:
        return False


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
        self.instance_id = secrets.token_hex(8)  # the gateway's /healthz names it: ours answers, no other
        # (backbone, device id) -> the socket of its backbone server; one server per device on GPU,
        # one per backbone on CPU (shared memory serves every simulated device)
        self.backbone_sockets: dict[tuple[str, str], Path] = {}
        self._backbone_bytes: dict[str, int] = {}
        self.sizing = self._sizing()
        cores = host_cores()
        self.pool_starts = config.pool_start_policy(self.device, cores, cpu_worker_threads(os.environ, cores))
        if self.pool_starts["max_pool_starts_per_node"] or self.pool_starts["pool_waits_for_demand"]:
            log.info(
                "warm pool on %d cores: at most %s standby start(s) at once%s",
                cores,
                self.pool_starts["max_pool_starts_per_node"] or "any number of",
                ", none while a request waits for its function's first worker"
                if self.pool_starts["pool_waits_for_demand"]
                else "",
            )
        self.executor = LocalExecutor(
            self.procs,
            self.device,
            env=self._component_env,
            backbone_socket=self._socket_of,
            backbone_bytes=self._bytes_of,
            resident=self._resident_on,
            kv_budget=self._kv_budget,
            num_devices=config.devices,
            device_memory_mib=config.device_memory_mib,
            zygote=ZygoteKeeper(self.state_dir / "sockets" / "zygote.sock", enabled=config.zygote),
            worker_extra_env={"LORAFN_GPU_ADMISSION": "true" if config.gpu_admission else "false"},
        )
        self.controller: Controller | None = None
        self.redis_watch = RedisWatch()
        self._redis_trouble = False  # a Redis call failed: check the server before the next round
        self.redis_restarts = 0
        self._redis_started_at = 0.0
        self._controller_generation = 0
        self.controller_restarts = 0
        self._controller_restart: str | None = None
        self._failed_rounds = 0

    def _sizing(self) -> SizingConfig:
        base = default_sizing(self.device)
        c = self.config
        return SizingConfig(
            worker_overhead_bytes=(
                c.worker_overhead_mib * MiB
                if c.worker_overhead_mib is not None
                else base.worker_overhead_bytes
            ),
            default_kv_bytes=c.default_kv_mib * MiB
            if c.default_kv_mib is not None
            else base.default_kv_bytes,
            fresh_start_s=base.fresh_start_s,
            bind_s=base.bind_s,
            capture_s=base.capture_s,
            private_weights=not c.share_backbone,
        )

    # -- start and stop --------------------------------------------------------------------------
    def start(self) -> PlatformState:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "sockets").mkdir(exist_ok=True)
        log.info("starting redis-server (data in %s)", self.redis.data_dir)
        self.redis.start()
        self._redis_started_at = time.monotonic()
        self.store = Store(self.redis.url)
        self.executor.start_zygote()  # its imports overlap the gateway's start
        self._start_gateway()
        self.executor.wait_zygote(self.config.worker_start_timeout_s)
        state = PlatformState(
            pid=os.getpid(),
            redis_url=self.redis.url,
            gateway_url=self.gateway_url,
            key_prefix=self.config.key_prefix,
            device=self.device,
        )
        state.write(self.state_dir)
        self.sync_backbones()
        self.controller = self._new_controller()  # it reads demand from its first wait on, not older
        if self.config.controller_metrics_port:
            self.controller.metrics.serve(self.config.controller_metrics_port, self.config.host)
        return state

    def _new_controller(self) -> Controller:
        """A controller with no memory of any before it (its own lease holder name: it takes the lease once a
        predecessor's lapses, as a restarted controller process does)."""
        self._controller_generation += 1
        controller = Controller(
            self.store,
            self.keys,
            self.executor,
            self.sizing,
            ControllerConfig(
                holder=f"{socket.gethostname()[:40]}-{os.getpid()}-c{self._controller_generation}",
                interval_s=self.config.poll_interval_s,
                heartbeat_ttl_s=self.config.heartbeat_ttl_s,
                preload_claims=self.config.preload_claims,
                policy=PolicyConfig(
                    gpu_utilization=self.config.gpu_utilization,
                    warm_pool=self.config.warm_pool,
                    offloading=self.config.offloading,
                    park_idle=self.config.park_idle,
                    parked_keep_alive_s=self.config.parked_keep_alive_s,
                    park_after_s=self.config.park_after_s,
                    batch_kv_bytes=self.config.batch_kv_bytes(self.device),
                    burst_kv_bytes=self.config.burst_kv_mib << 20,
                    scale_up_wait_fraction=self.config.scale_up_wait_fraction,
                    **self.pool_starts,
                    **burst_overrides(
                        self.config.cold_prior_rps,
                        self.config.max_fresh_starts_per_gpu,
                        self.config.thrash_horizon_starts,
                    ),
                ),
            ),
        )
        if self.controller is not None:
            controller.metrics = self.controller.metrics  # the served registry keeps counting
            controller.demand_cursor = self.controller.demand_cursor  # demand since then still wakes it
        return controller

    def restart_controller(self, reason: str) -> None:
        """Replace the in-process controller by a fresh one, as if its process had crashed and restarted:
        binds in flight, the events it read and the stops it sent are forgotten; the new one rebuilds its
        view from Redis and the executor's processes (`lorafn up` on SIGUSR1, and after
        `CONTROLLER_MAX_FAILED_ROUNDS` failed rounds in a row)."""
        log.warning("restarting the controller: %s", reason)
        self.controller = self._new_controller()
        self.controller_restarts += 1
        self._failed_rounds = 0

    def request_controller_restart(self, reason: str) -> None:
        """Safe from a signal handler: the next tick restarts the controller."""
        self._controller_restart = reason

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
            # batch files live in the state dir (docs/batch.md)
            env={
                **self._component_env(),
                "LORAFN_INSTANCE_ID": self.instance_id,
                "LORAFN_FILES_DIR": str(self.state_dir / "files"),
            },
        )
        self.procs.wait_until(
            child, lambda: gateway_answers(self.gateway_url, self.instance_id), timeout_s=60
        )
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
    def _server_devices(self) -> list[tuple[str, str]]:
        """(device id, torch device) of each backbone server to run: one per GPU, one on CPU."""
        devices = [(gid, dev) for gid, dev, _ in self.executor.devices]
        return devices if self.device == "cuda" else devices[:1]

    def _socket_of(self, backbone: str, gpu: str) -> Path | None:
        if self.device != "cuda":
            gpu = self.executor.devices[0][0]
        return self.backbone_sockets.get((backbone, gpu))

    def _resident_on(self, gpu: str) -> list[str]:
        """Backbones a worker on `gpu` can map (without sharing: every registered one, loaded privately)."""
        if not self.config.share_backbone:
            return sorted(self._backbone_bytes)
        if self.device != "cuda":
            gpu = self.executor.devices[0][0]
        return sorted(name for name, g in self.backbone_sockets if g == gpu)

    def _bytes_of(self, backbone: str) -> int:
        # On CPU the one shared-memory copy is host memory, not a device's: it does not count against
        # the simulated devices' accounts. On GPU every device holds a copy. Without sharing there is no
        # shared copy: each worker's own weights are part of its size (SizingConfig.private_weights).
        if not self.config.share_backbone or self.device != "cuda":
            return 0
        return self._backbone_bytes.get(backbone, 0)

    def _kv_budget(self, action: Start) -> int:
        assert self.controller is not None
        reader = self.controller.reader
        size = reader.sizes.get(action.function or "")
        if size is not None:
            # a worker with adapter slots holds the KV of every function that may join it (`decide`'s
            # start_bytes): one budget shared by their requests
            return size.kv_bytes * action.adapter_slots
        # a standby: its KV is what its grant holds beyond the rest (the planner sized it for the largest
        # cold function of its shape; with the default KV it could never take a function of a larger budget)
        return reader.standby_kv_bytes(action.mem_bytes, action.shape, action.backbone)

    def sync_backbones(self) -> None:
        """Start a backbone server for each registered backbone and device that has none."""
        assert self.store is not None
        for name in self.store.run(list_backbones(self.keys)):
            record = self.store.run(get_backbone(self.keys, name))
            if record is None:
                continue
            if name not in self._backbone_bytes:
                self._backbone_bytes[name] = sum(
                    p.stat().st_size for p in Path(record.model_dir).glob("*.safetensors")
                )
            if not self.config.share_backbone:
                continue
            for gid, dev in self._server_devices():
                proc_name = f"backbone/{name}/{gid.replace('/', '-')}"
                if proc_name in self.procs.children and self.procs.children[proc_name].alive():
                    continue
                socket_path = self.state_dir / "sockets" / f"{name}.{gid.replace('/', '-')}.sock"
                socket_path.unlink(missing_ok=True)
                log.info("loading backbone %s from %s on %s", name, record.model_dir, dev)
                child = self.procs.start(
                    proc_name,
                    lorafn_argv(
                        "backbone-server", "serve", "--model", record.model_dir, "--socket", str(socket_path),
                        "--device", dev,
                    ),
                )  # fmt: skip
                self.procs.wait_until(
                    child, socket_path.exists, timeout_s=self.config.backbone_start_timeout_s, poll_s=0.2
                )
                self.backbone_sockets[(name, gid)] = socket_path
                log.info("backbone %s ready on %s (socket %s)", name, gid, socket_path)

    # -- the loop ------------------------------------------------------------------------------------
    def _reap(self) -> None:
        for child in self.procs.reap():
            code = child.exit_code()
            if child.name.startswith("worker/"):
                self.executor.note_exit(child)
            elif child.name == "gateway":
                log.error("the gateway died (code %s); restarting it. Log tail:\n%s", code, child.log_tail())
                self._start_gateway()
            elif child.name == ZYGOTE_NAME:
                self.executor.zygote_exited(child)
            elif child.name.startswith("backbone/"):
                log.error("backbone server %s died (code %s):\n%s", child.name, code, child.log_tail())
                _, name, dev = child.name.split("/", 2)
                self.backbone_sockets = {
                    k: v
                    for k, v in self.backbone_sockets.items()
                    if not (k[0] == name and k[1].replace("/", "-") == dev)
                }

    def tick(self, block_ms: int) -> None:
        """One supervisor iteration: reap, start backbones, wait briefly for demand (the controller's own
        wait, `Controller.wait_for_demand`), answer it from the last snapshot (`answer_demand`: a standby is
        bound within milliseconds of the request), then one full controller round.

        Redis trouble never ends `lorafn up`: while the server does not answer, the tick only supervises
        it (restart when it exited or hung, `_supervise_redis`); the gateway answers 503 meanwhile and the
        workers and the controller carry on once it is back (issue 15)."""
        assert self.store is not None and self.controller is not None
        self._reap()
        if (self._redis_trouble or not self.redis.alive()) and not self._supervise_redis():
            time.sleep(min(0.5, block_ms / 1000))
            return
        try:  # a backbone server that cannot start still ends `lorafn up` (procs.RestartPolicy)
            self.sync_backbones()
            # The gateway records cold-start demand: waking on it answers it at once.
            demand = self.controller.wait_for_demand(block_ms / 1000)
        except UNAVAILABLE_ERRORS as e:
            log.warning("redis is unreachable (%s); checking the server", e)
            self._redis_trouble = True
            return
        try:
            if self._controller_restart is not None:
                reason, self._controller_restart = self._controller_restart, None
                self.restart_controller(reason)
            self.controller.answer_demand(demand)
            self.controller.round()
            self._failed_rounds = 0
        except UNAVAILABLE_ERRORS as e:
            log.warning("redis is unreachable (%s); checking the server", e)
            self._redis_trouble = True
        except Exception:  # a bad round (a bad record, a bug) must not take the platform down
            log.exception("controller round failed; trying again next tick")
            self._failed_rounds += 1
            if self._failed_rounds >= CONTROLLER_MAX_FAILED_ROUNDS:  # its memory may be what is broken
                self.restart_controller(f"{self._failed_rounds} failed rounds in a row")

    def _supervise_redis(self) -> bool:
        """True when Redis answers. Else restart it when it exited or stopped answering for
        `RedisWatch.hang_s` (same port, password and data directory: the AOF brings back registrations,
        queued requests and consumer groups; workers re-create a lost group themselves), with the process
        group's backoff (a server that dies soon after each start, with the same last log line five times
        in a row, ends `lorafn up` with a RuntimeError naming it)."""
        alive = self.redis.alive()
        verdict = self.redis_watch.verdict(alive, alive and self.redis.answers(), time.monotonic())
        if verdict == "ok":
            if self._redis_trouble:
                log.info("redis answers again")
            self._redis_trouble = False
            return True
        self._redis_trouble = True
        if verdict == "wait":
            return False
        if alive:
            log.error("redis-server (pid %s) stopped answering; killing it", self.redis.pid)
            self.redis.kill()
        else:
            log.error(
                "redis-server died (code %s); restarting it from its AOF. Log tail:\n%s",
                self.redis.exit_code(),
                self.redis.log_tail(),
            )
        policy = self.procs.restarts
        lines = self.redis.log_tail().strip().splitlines()
        policy.exited("redis", time.monotonic() - self._redis_started_at, lines[-1] if lines else "")
        reason = policy.give_up("redis")
        if reason is not None:
            raise RuntimeError(f"redis-server cannot be kept running: {reason}")
        time.sleep(policy.delay_s("redis"))
        self._redis_started_at = time.monotonic()
        try:
            self.redis.start(timeout_s=REDIS_START_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as e:  # the next tick finds it dead and tries again
            log.error("redis-server did not start again: %s", e)
            return False
        self.redis_restarts += 1
        log.warning("redis-server restarted (pid %s, port %s)", self.redis.pid, self.redis.port)
        self._redis_trouble = False
        return True

    def serve_forever(self, stop_after_s: float | None = None) -> None:
        deadline = None if stop_after_s is None else time.monotonic() + stop_after_s
        block_ms = int(self.config.poll_interval_s * 1000)
        while deadline is None or time.monotonic() < deadline:
            self.tick(block_ms)


__all__ = ["LocalPlatform", "gpu_id", "http_ok"]
