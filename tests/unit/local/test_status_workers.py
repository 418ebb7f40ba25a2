"""`lorafn status`'s Workers table: requests in flight per worker (from its heartbeat) and the busy workers
per device under it (each busy worker's decode step reads the whole backbone)."""

from __future__ import annotations

import io

from rich.console import Console

from lorafn.local.status import PlatformStatus, WorkerView, _worker, busy_per_device, render_status


def _w(wid: str, gpu: str, running: int = 0, parked: bool = False) -> WorkerView:
    return WorkerView(wid, "a/f", "serving", gpu, "tiny", "r8", 100, "0", "1", parked=parked, running=running)


def test_a_heartbeat_s_running_count_reaches_the_view() -> None:
    assert _worker("w", {"state": "serving", "running": "3"}).running == 3
    assert _worker("w", {"state": "standby"}).running == 0  # a standby's heartbeat has no such field


def test_busy_workers_per_device_leave_out_idle_and_parked_ones() -> None:
    workers = [
        _w("1", "cuda:0", 2),
        _w("2", "cuda:0"),
        _w("3", "cuda:1", 1),
        _w("4", "cuda:1", 1, parked=True),
    ]
    assert busy_per_device(workers) == {"cuda:0": 1, "cuda:1": 1}
    out = io.StringIO()
    render_status(PlatformStatus("http://gw", "redis://r", workers=workers), Console(file=out, width=160))
    text = out.getvalue()
    assert "running" in text and "busy workers (requests in flight) per device: cuda:0 1, cuda:1 1" in text
    quiet = io.StringIO()
    render_status(
        PlatformStatus("http://gw", "redis://r", workers=[_w("2", "cuda:0")]), Console(file=quiet, width=160)
    )
    assert "busy workers" not in quiet.getvalue()


def test_a_worker_with_adapter_slots_shows_every_function_it_serves() -> None:
    """A worker that functions joined (docs/runtime.md#adapter-slots) lists them all in its heartbeat."""
    fields = {"state": "serving", "function": "a/f", "functions": "a/f,a/g"}
    assert _worker("w", fields).function == "a/f,a/g"
    assert _worker("w", {"state": "serving", "function": "a/f"}).function == "a/f"
