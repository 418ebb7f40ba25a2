"""Runs a model check (a `tests.integration.runtime.*_check` module) in a child with Triton's interpreter
(TRITON_INTERPRET must be set before triton is imported): a tiny llama written with transformers and real PEFT
adapters, passed as `MODEL_DIR NAME=ADAPTER_DIR ...`.

The checks are CPU-bound (every kernel run by numpy) and one child uses about one core, so `ModelChecks`
(the `model_checks` fixture) starts the selected tests' checks two at a time, the longest first, when the
first of those tests runs; each test then waits for its own child's result. On CI's 2-core machine their ~10
minutes one after another take about the longest one's time. Nothing else runs meanwhile: the tests that own
the checks are next to one another in the session, and each waits for its child."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.runtime.engine_helpers import write_hf_model, write_peft_adapter
from tests.unit.runtime.interpreted import ROOT

CHECK_TIMEOUT_S = 1150  # below the owning tests' pytest timeout (1200 s)
PARALLEL_CHECKS = 2  # CI's cores


@dataclass(frozen=True)
class ModelCheck:
    """One test's model check: `python -m module *flags MODEL_DIR NAME=ADAPTER_DIR ...` (adapter i written
    with seed + i); `cost_s`, its rough time on a 2-core VM, orders the pool (the longest first)."""

    module: str
    adapters: dict
    flags: tuple[str, ...] = ()
    seed: int = 0
    cost_s: float = 60.0


def _command(check: ModelCheck, tiny_model_dir: Path, workdir: Path) -> list[str]:
    """Writes the check's model and adapters under `workdir`; the child's command line."""
    model = write_hf_model(workdir / "m", tiny_model_dir, "llama")
    args = [*check.flags, str(model)]
    for i, (name, kwargs) in enumerate(check.adapters.items()):
        args.append(f"{name}={write_peft_adapter(model, workdir / name, seed=check.seed + i, **kwargs)}")
    return [sys.executable, "-m", check.module, *args]


def _outcome(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n(killed after {timeout:.0f} s)"
    return proc.returncode, out, err


def _stdout(returncode: int, out: str, err: str) -> str:
    """The child's stdout, which must end in "ok" with exit status 0."""
    assert returncode == 0 and out.strip().endswith("ok"), out[-2000:] + err[-4000:]
    return out


def _spawn(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


@dataclass
class ModelChecks:
    """The selected tests' model checks, run PARALLEL_CHECKS at a time in the background (started by
    `start`); `stdout(test name)` waits for that test's check."""

    workdir: Callable[[str], Path]  # a fresh directory for a check's model and adapters
    tiny_model_dir: Path
    futures: dict[str, Future] = field(default_factory=dict)
    children: list[subprocess.Popen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(PARALLEL_CHECKS))

    def start(self, checks: dict[str, ModelCheck]) -> None:
        """Writes every check's inputs (here, in pytest's thread), then queues the children, the longest
        first."""
        commands = {name: _command(c, self.tiny_model_dir, self.workdir(name)) for name, c in checks.items()}
        for name in sorted(checks, key=lambda n: -checks[n].cost_s):
            self.futures[name] = self.pool.submit(self._run, commands[name])

    def _run(self, command: list[str]) -> tuple[int, str, str]:
        proc = _spawn(command)
        with self.lock:
            self.children.append(proc)
        return _outcome(proc, CHECK_TIMEOUT_S)

    def stdout(self, test: str) -> str:
        """The check of `test` (its function's name): its stdout, which must end in "ok" with exit 0."""
        if test not in self.futures:
            raise KeyError(f"no model check was started for {test}")
        return _stdout(*self.futures[test].result())

    def close(self) -> None:
        """Kills what still runs (a test interrupted or timed out), waits for the pool."""
        for future in self.futures.values():
            future.cancel()
        with self.lock:
            for proc in self.children:
                if proc.poll() is None:
                    proc.kill()
        self.pool.shutdown(wait=True)


def selected_model_checks(items: list[pytest.Item]) -> dict[str, ModelCheck]:
    """The model checks of the selected tests: each test module's MODEL_CHECKS, by test function name."""
    checks: dict[str, ModelCheck] = {}
    for item in items:
        declared = getattr(getattr(item, "module", None), "MODEL_CHECKS", {})
        name = getattr(item, "originalname", item.name)
        if name in declared:
            checks[name] = declared[name]
    return checks
