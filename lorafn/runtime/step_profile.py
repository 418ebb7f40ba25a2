"""Profile a worker's first engine steps with torch.profiler, off unless asked for.

Why: on the H100 a standby's first request after a bind prefilled in 139 ms where the same worker's next
requests took 63, 52 and 50 ms (docs/benchmarks.md, cold start, fourth session), with GPU clocks at their
maximum and no garbage collection; per-request timing cannot say which kernels or host calls the first
steps spend it on. `LORAFN_PROFILE_STEPS=N` (and `LORAFN_PROFILE_DIR`) records the worker's first N engine
steps and writes, per worker, a table of the operators and kernels by device time (and host time) with each
step's wall time, plus a Chrome trace (open in chrome://tracing or Perfetto).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("lorafn.worker")


class StepProfiler:
    """Wraps engine steps: the first `steps` of them are recorded, then the files are written once."""

    def __init__(self, steps: int, out_dir: str | Path | None, name: str) -> None:
        if steps < 0:
            raise ValueError(f"profile_steps: must be >= 0, got {steps}")
        self.steps, self.name = steps, name
        self.out_dir = Path(out_dir) if out_dir else Path.cwd()
        self._prof: Any = None
        self._seen = 0
        self._walls_ms: list[float] = []
        self.written: list[Path] = []

    @property
    def active(self) -> bool:
        return self._seen < self.steps

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if not self.active:
            yield
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        if self._prof is None:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        cuda = torch.cuda.is_available()
        started = time.perf_counter()
        try:
            with record_function(f"lorafn_step_{self._seen}"):
                yield
        finally:
            if cuda:
                torch.cuda.synchronize()  # the step's wall time includes its kernels (profiling only)
            self._walls_ms.append((time.perf_counter() - started) * 1000)
            self._seen += 1
            if not self.active:
                self._finish(cuda)

    def _finish(self, cuda: bool) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        table = self.out_dir / f"{self.name}.steps.txt"
        trace = self.out_dir / f"{self.name}.trace.json"
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        averages = prof.key_averages()
        walls = ", ".join(f"{ms:.1f}" for ms in self._walls_ms)
        table.write_text(
            f"worker {self.name}: first {len(self._walls_ms)} engine steps, wall ms: {walls}\n\n"
            f"by {sort}:\n{averages.table(sort_by=sort, row_limit=60)}\n"
            f"by cpu_time_total:\n{averages.table(sort_by='cpu_time_total', row_limit=40)}\n"
        )
        prof.export_chrome_trace(str(trace))
        self.written = [table, trace]
        log.info("worker %s: profile of its first %d steps in %s", self.name, len(self._walls_ms), table)
