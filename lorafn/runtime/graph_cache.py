"""A worker's decode graphs through the graph archive (issue 11 item 2, DESIGN idea 5).

`EngineConfig.graph_archives` on CUDA: the `ModelRunner` builds its decode state (LoRA buffers, the model's
own tensors, the KV cache, the graphs' static inputs) in the arena's state pool (arena.py), in one fixed
order, while the backbone is the server's read-only mapping W at its fixed address. Two workers of the same
key (backbone layout, adapter shape, KV blocks, buckets, software versions: graph_restore.current_key)
then have every tensor a decode graph touches at the same virtual addresses, so the graphs one of them
captured are rebuilt in the other without capturing (graph_restore.restore_graphs).

- The first worker of a key captures (eagerly, a standby; one bucket at a time, a lazily started one) and,
  once every bucket is captured, writes the archive (`<archive dir>/graphs/<key digest>.lfgraph`).
- A later worker of the key restores every bucket at once: a standby at start, a lazy worker when its
  first decode step needs a graph (it serves its first token before, as without archives). A restore is
  checked (self-check replays against the capturing process's digests); any refusal (key, layout,
  corruption, a failed check) is logged with its reason and the worker captures instead.
- The self-check replays run with the LoRA buffers holding one deterministic pattern (`lora_pattern`) in
  both processes, whatever adapter either holds, so a bound worker's archive serves a standby of its shape
  and the reverse; the adapter's values are put back after.

Pure bookkeeping (the archive's path, when to write) is here; the CUDA work is graph_restore.py's.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


class ArchivedGraphs:
    """The arena of one worker process and its graph archive (one per ModelRunner in archive mode)."""

    def __init__(self, device: torch.device, cache_dir: Path, archive_dir: Path) -> None:
        from lorafn.runtime.arena import Arena

        self.arena = Arena(device, cache_dir)
        self.archive_dir = Path(archive_dir)
        self.state_top = 0
        self.state_log: list[tuple[int, int]] = []
        self.key: dict[str, Any] | None = None
        self.path: Path | None = None
        self.outcome = ""  # "restored", "captured", "lazy", or why archives were not used
        self.restore_s = 0.0
        self.written = False
        self.usable = True  # False once state changed outside the arena (a bind of another shape)
        self._gc_was_enabled = gc.isenabled()
        # a collection during the build could free a temporary at another point: other addresses
        gc.collect()
        gc.disable()

    @contextlib.contextmanager
    def state(self) -> Iterator[None]:
        """Allocations inside go to the arena's state pool (only the decode state's, in its fixed order)."""
        with torch.cuda.use_mem_pool(self.arena.state_pool):
            yield

    def state_built(self, key: dict[str, Any]) -> None:
        """The state is complete: its layout and key are fixed now."""
        from lorafn.runtime.graph_archive import archive_path

        torch.cuda.synchronize()
        self.state_top = self.arena.bump
        self.state_log = self.arena.allocation_log()
        self.key = key
        self.path = archive_path(self.archive_dir, key)
        if self._gc_was_enabled:
            gc.enable()

    def abandon(self, why: str) -> None:
        """No archive work from now on (the state the graphs would touch is no longer the arena's)."""
        if self._gc_was_enabled:
            gc.enable()
        self.usable = False
        self.outcome = why

    @property
    def available(self) -> bool:
        return self.usable and self.path is not None and self.path.exists()

    def restore(self, runner: Any) -> bool:
        """Every bucket's graph from the archive into `runner` (a DecodeGraphRunner with nothing captured);
        False (logged with the reason) when there is no usable archive or it was refused."""
        from lorafn.runtime.graph_restore import restore_archived

        if not self.available or runner.graphs:
            return False
        t0 = time.perf_counter()
        report, why = restore_archived(
            self.path,  # type: ignore[arg-type]
            runner,
            self.arena,
            self.key,  # type: ignore[arg-type]
            self.state_top,
            self.state_log,
            selfcheck="all",
        )
        if report is None:
            # a refusal after the reserve leaves the range reserved: later captures go above it, fine
            self.outcome = f"refused: {why}"
            return False
        self.restore_s = time.perf_counter() - t0
        self.outcome = "restored"
        self.written = True  # nothing new to write
        log.info(
            "decode graphs: %d buckets restored from %s in %.0f ms (%s)",
            len(runner.graphs), self.path.name, self.restore_s * 1000,  # type: ignore[union-attr]
            ", ".join(f"{k} {v * 1000:.0f}" for k, v in report.stages.items()),
        )  # fmt: skip
        return True

    def capture(self, runner: Any, buckets: list[int] | None = None) -> float:
        """Capture `buckets` (default: every pending one) in the arena's pools, keeping each graph for the
        archive; writes the archive once every bucket is captured. Seconds taken (capture only)."""
        seconds = runner.capture(
            pool=self.arena.graph_pool.id,
            warmup_pool=self.arena.scratch_pool,
            keep_graph=True,
            buckets=buckets,
        )
        if not self.outcome:
            self.outcome = "captured"
        if not runner.pending:
            self.write(runner)
        return seconds

    def write(self, runner: Any) -> None:
        """The archive of `runner`'s graphs, once (a failure is logged: the worker serves on regardless)."""
        from lorafn.runtime.graph_archive import write_archive
        from lorafn.runtime.graph_restore import GraphRestoreError, archive_graphs

        if self.written or not self.usable or self.path is None or self.key is None:
            return
        self.written = True
        t0 = time.perf_counter()
        try:
            archive = archive_graphs(runner, self.arena, self.key, self.state_top, self.state_log)
            write_archive(self.path, archive)
        except (GraphRestoreError, OSError, ValueError) as exc:
            log.warning("decode graphs: not archived (%s)", exc)
            return
        log.info("decode graphs: archived to %s in %.0f ms", self.path, (time.perf_counter() - t0) * 1000)
