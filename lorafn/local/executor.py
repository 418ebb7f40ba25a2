"""The controller's hands on one machine: worker processes as children of `lorafn up`.

Devices: on a GPU machine, every GPU (`local/<index>`, total memory read with `nvidia-smi`); on CPU,
`devices` simulated devices of `device_memory_mib` each (the same policy runs; the account is what
keeps workers from oversubscribing the host). A worker starts as `lorafn worker serve` with the budget
the controller granted (`--kv-budget-mib`), on its device, mapping the backbone server's copy
(`LORAFN_BACKBONE_SOCKET`): a standby with `--standby --backbone B [--shape S]`, a bound one with
`--function F`.

Workers are forked from the zygote (`local.zygote`: a process that has imported torch and the runtime,
so a worker skips seconds of imports) when it runs, else spawned as new processes; either way they are
children the platform reaps, signals and reads the logs of in the same way.

On CPU the zygote and the workers run with OpenMP's passive wait policy (`cpu_compute_env`): several
workers compute at once on the host's cores, and OpenMP's default spin-waiting made each of them thrash
the others.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from lorafn.api.sizing import MiB
from lorafn.controller.driver import Exit
from lorafn.controller.policy.actions import Start
from lorafn.controller.policy.model import GPU, Worker
from lorafn.local.procs import Child, ProcessGroup, lorafn_argv
from lorafn.local.zygote import ZYGOTE_NAME, ZygoteKeeper, become_subreaper

log = logging.getLogger("lorafn.up")

CPU_DEVICE_MIB = 16384


def cpu_compute_env(env: Mapping[str, str]) -> dict[str, str]:
    """What a torch process that computes on the host's cores (the zygote, a CPU worker) adds to its
    environment: ``OMP_WAIT_POLICY=PASSIVE`` unless ``env`` sets a policy. libgomp's default lets a thread
    that waits at a parallel region's end spin for ~300k iterations while it believes it has its core, and
    every worker believes it has every core: on the 2-core VM two workers at once took a 37-token prefill
    from 112 ms alone to ~5000 ms each and a decode step from 54 to ~880 ms; passive, 194 ms and 60 ms
    (alone 128 ms and 56 ms; docs/benchmarks.md, "The README demo"). Read once, when torch loads: the zygote
    must start with it (its forks inherit it)."""
    return {} if "OMP_WAIT_POLICY" in env else {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass
class _Tracked:
    child: Child
    action: Start
    started: float
    stopping: bool = False  # the controller asked it to stop: a signal exit is not a failure


def gpu_id(index: int) -> str:
    return f"local/{index}"


def query_gpus() -> list[tuple[int, int]]:
    """(index, total bytes) of each GPU, from nvidia-smi (no CUDA context, no torch)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        index, total = (p.strip() for p in line.split(","))
        gpus.append((int(index), int(total) * MiB))
    return gpus


class LocalExecutor:
    """Starts worker processes for the controller and tells it which are still coming up or ended."""

    reports_every_exit = True  # it reaps every worker (forked or spawned) and reports each end

    def __init__(
        self,
        procs: ProcessGroup,
        device: str,
        env: Callable[[], dict[str, str]],
        backbone_socket: Callable[[str, str], Path | None],
        backbone_bytes: Callable[[str], int],
        resident: Callable[[str], list[str]],
        kv_budget: Callable[[Start], int],
        num_devices: int | None = None,
        device_memory_mib: int | None = None,
        worker_extra_env: dict[str, str] | None = None,
        zygote: ZygoteKeeper | None = None,
    ) -> None:
        self.procs, self.device, self.env = procs, device, env
        self.backbone_socket, self.backbone_bytes, self.resident = backbone_socket, backbone_bytes, resident
        self.kv_budget = kv_budget
        self.worker_extra_env = worker_extra_env or {}
        if device == "cuda":
            found = query_gpus()
            if not found:
                raise ValueError("device: cuda, but nvidia-smi lists no GPU")
            found = found[: num_devices or len(found)]
            self.devices = [
                (gpu_id(i), f"cuda:{i}", device_memory_mib * MiB if device_memory_mib else total)
                for i, total in found
            ]
        else:
            n = num_devices or 1
            size = (device_memory_mib or CPU_DEVICE_MIB) * MiB
            self.devices = [(gpu_id(i), "cpu", size) for i in range(n)]
        self.tracked: dict[str, _Tracked] = {}
        self._exits: list[Exit] = []
        self.zygote = zygote

    # -- the zygote ------------------------------------------------------------------------------
    def start_zygote(self) -> None:
        """Start the zygote (it imports for seconds; workers are spawned plainly until it listens)."""
        if self.zygote is None or not self.zygote.enabled:
            return
        if not become_subreaper():
            log.warning("not a child subreaper: exit codes of workers outliving a dead zygote are lost")
        self.zygote.started_at = time.monotonic()
        env = cpu_compute_env(os.environ) if self.device == "cpu" else {}
        self.procs.start(ZYGOTE_NAME, self.zygote.argv(), env=env)
        log.info("zygote starting (socket %s)", self.zygote.socket_path)

    def wait_zygote(self, timeout_s: float) -> bool:
        """Wait until the zygote listens; False (logged) when it died or took longer."""
        child = self.procs.children.get(ZYGOTE_NAME)
        if self.zygote is None or child is None:
            return False
        try:
            self.procs.wait_until(child, self.zygote.ready, timeout_s=timeout_s, poll_s=0.1)
        except (RuntimeError, TimeoutError) as e:
            log.warning("the zygote is not ready (%s); workers are spawned until it is", e)
            return False
        log.info("zygote ready: workers are forked from it")
        return True

    def zygote_exited(self, child: Child) -> None:
        """Called by the reaper: log the zygote's end and start a new one (unless it keeps dying)."""
        assert self.zygote is not None
        code = child.exit_code()
        log.error("the zygote died (code %s); log tail:\n%s", code, child.log_tail(1500))
        self.zygote.socket_path.unlink(missing_ok=True)
        if self.zygote.exited(code, time.monotonic() - self.zygote.started_at):
            self.start_zygote()

    # -- Executor ------------------------------------------------------------------------------
    def gpus(self) -> list[GPU]:
        out = []
        for gid, _dev, total in self.devices:
            backbones = {name: self.backbone_bytes(name) for name in self.resident(gid)}
            out.append(GPU(id=gid, node="local", total_bytes=total, backbones=backbones))
        return out

    def torch_device(self, gid: str) -> str:
        for g, dev, _ in self.devices:
            if g == gid:
                return dev
        raise ValueError(f"gpu {gid!r} is not one of this machine's devices {[d[0] for d in self.devices]}")

    def start(self, action: Start, worker_id: str) -> None:
        argv = [
            "worker", "serve", "--worker-id", worker_id, "--device", self.torch_device(action.gpu),
            "--gpu", action.gpu, "--kv-budget-mib", str(max(1, self.kv_budget(action) // MiB)),
        ]  # fmt: skip
        if action.function:
            argv += ["--function", action.function]
        else:
            argv += ["--standby", "--backbone", action.backbone]
            if action.shape:
                argv += ["--shape", action.shape]
        if action.adapter_slots > 1:  # docs/runtime.md#adapter-slots (the policy sets it only with a shape)
            argv += ["--adapter-slots", str(action.adapter_slots)]
        env = {**self.env(), **self.worker_extra_env}
        if self.device == "cuda":
            # A GPU worker needs few CPU threads, and dozens of workers each starting one OpenMP thread per
            # core oversubscribe the host (binds took 3-19 s on a 16-core H100 host with a few starting).
            env.setdefault("OMP_NUM_THREADS", "1")
            env.setdefault("MKL_NUM_THREADS", "1")
        else:  # a spawned one reads it as torch loads (a forked one has the zygote's)
            env.update(cpu_compute_env({**os.environ, **env}))
        if action.function:  # a fresh cold start: the worker reports spawn -> serving to the controller
            env["LORAFN_SPAWNED_AT_MS"] = str(int(time.time() * 1000))
        socket = self.backbone_socket(action.backbone, action.gpu)
        if socket is not None:
            env["LORAFN_BACKBONE_SOCKET"] = str(socket)
        fork = self.zygote.fork if self.zygote is not None and self.zygote.enabled else None
        child = self.procs.start(f"worker/{worker_id}", lorafn_argv(*argv), env=env, fork=fork)
        self.tracked[worker_id] = _Tracked(child, action, time.monotonic())
        what = action.function or f"standby of {action.backbone}"
        how = "forked from the zygote" if child.forked else "spawned"
        log.info("worker %s (%s) on %s %s, pid %d", worker_id, what, action.gpu, how, child.pid)

    def stop(self, worker_id: str) -> None:
        """SIGTERM: the worker drains (finishes what it runs) and exits; the reaper collects it."""
        tracked = self.tracked.get(worker_id)
        if tracked is not None and tracked.child.alive():
            tracked.stopping = True
            tracked.child.proc.terminate()

    def starting(self) -> list[Worker]:
        """Every worker process still alive, as the controller counts it until its heartbeat replaces it."""
        now = time.monotonic()
        return [
            Worker(
                id=wid,
                gpu=t.action.gpu,
                backbone=t.action.backbone,
                state="starting",
                shape=t.action.shape,
                function=t.action.function,
                mem_bytes=t.action.mem_bytes,
                age_s=now - t.started,
            )
            for wid, t in self.tracked.items()
            if t.child.alive()
        ]

    def exits(self) -> list[Exit]:
        out, self._exits = self._exits, []
        return out

    # -- called by the platform's reaper ---------------------------------------------------------
    def note_exit(self, child: Child) -> None:
        wid = child.name.removeprefix("worker/")
        tracked = self.tracked.pop(wid, None)
        code = child.exit_code()
        if tracked is not None and tracked.stopping and code is not None and code < 0:
            code = 0  # killed by the SIGTERM we sent before it had installed its drain handler
        if code == 0:
            log.info("worker %s exited (idle past keep-alive, drained or stopped)", wid)
        else:
            log.error("worker %s died with code %s; log tail:\n%s", wid, code, child.log_tail())
        function = tracked.action.function if tracked else None
        last_line = (child.log_tail(2000).strip().splitlines() or [""])[-1]
        self._exits.append(Exit(wid, function, code, last_line))

    def stop_all(self) -> None:
        for wid in list(self.tracked):
            self.stop(wid)
