"""`lorafn logs`: the log files of the local platform's processes, by what a user calls them.

`<state dir>/logs/` holds one file per process: `gateway.log`, `backbone_<name>_<device>.log`,
`worker_<worker id>.log`, and `up.log` for a `lorafn up --detach`. A function's workers are found by id:
the live ones from their heartbeats, the earlier ones from the lifecycle events they posted when they
took the function (bound from standby, or started fresh for it) or failed to.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from lorafn.store import Keys, Store, control
from lorafn.store.workers import worker_ids, worker_info

TARGETS_HELP = (
    "NAMESPACE/NAME (a function's workers), gateway, backbone, backbone/NAME, or up (a detached lorafn up)"
)


def function_worker_ids(store: Store, keys: Keys, function: str) -> list[str]:
    """Ids of every worker that served or tried to serve `function`, oldest first."""
    found: list[str] = []
    for _, event in store.run(control.read_events(keys, "0-0", count=100_000)):
        wid = event.get("worker", "")
        if event.get("function") == function and wid and wid not in found:
            found.append(wid)
    ids = store.run(worker_ids(keys))
    for wid, fields in (store.run(worker_info(keys, ids)) if ids else {}).items():
        if fields.get("function") == function and wid not in found:
            found.append(wid)
    return found


def log_files(
    log_dir: Path, target: str, worker_ids_of: Callable[[str], list[str]]
) -> list[tuple[str, Path]]:
    """(label, path) of the existing log files of `target`; ValueError naming what exists otherwise."""
    if target == "gateway":
        paths = [log_dir / "gateway.log"]
    elif target == "up":
        paths = [log_dir / "up.log"]
    elif target == "backbone" or target.startswith("backbone/"):
        name = target.partition("/")[2]
        paths = sorted(log_dir.glob(f"backbone_{name + '_' if name else ''}*.log"))
    elif "/" in target:
        paths = [log_dir / f"worker_{wid}.log" for wid in worker_ids_of(target)]
        paths = [p for p in paths if p.exists()]
        if not paths:
            raise ValueError(
                f"no worker of {target} has run yet (one starts on its first invocation); "
                "`lorafn get functions` lists the functions"
            )
    else:
        raise ValueError(f"logs of {target!r}: give {TARGETS_HELP}")
    existing = [p for p in paths if p.exists()]
    if not existing:
        raise ValueError(f"no log of {target} in {log_dir}")
    return [(_label(p), p) for p in existing]


def _label(path: Path) -> str:
    return path.stem.removeprefix("worker_")


def _tail_lines(path: Path, lines: int) -> tuple[list[str], int]:
    """The last `lines` lines (all when < 0) of `path`, and the offset after them."""
    data = path.read_bytes()
    text = data.decode(errors="replace").splitlines(keepends=True)
    return (text if lines < 0 else text[-lines:] if lines else []), len(data)


def show(
    files: list[tuple[str, Path]],
    tail: int = -1,
    follow: bool = False,
    out: TextIO = sys.stdout,
    refresh: Callable[[], list[tuple[str, Path]]] | None = None,
    poll_s: float = 0.3,
    stop: Callable[[], bool] = lambda: False,
) -> None:
    """Print the files (each line prefixed with its process when there are several); with `follow`, keep
    printing what they append, and files `refresh()` adds (a function's new workers), until `stop()`."""
    prefix = len(files) > 1 or refresh is not None
    offsets: dict[Path, int] = {}
    labels: dict[Path, str] = {}

    def emit(label: str, lines: list[str]) -> None:
        for line in lines:
            out.write(f"[{label}] {line}" if prefix else line)
        if lines and not lines[-1].endswith("\n"):
            out.write("\n")
        out.flush()

    for label, path in files:
        lines, offsets[path] = _tail_lines(path, tail)
        labels[path] = label
        emit(label, lines)
    last_refresh = time.monotonic()
    while follow and not stop():
        time.sleep(poll_s)
        if refresh is not None and time.monotonic() - last_refresh > 2.0:
            last_refresh = time.monotonic()
            for label, path in refresh():
                if path not in offsets:
                    offsets[path], labels[path] = 0, label
        for path, offset in list(offsets.items()):
            try:
                with path.open("rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            cut = data.rfind(b"\n") + 1  # whole lines only; the rest comes with the next read
            if cut:
                offsets[path] = offset + cut
                emit(labels[path], data[:cut].decode(errors="replace").splitlines(keepends=True))
