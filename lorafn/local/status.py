"""`lorafn status`: what the running local platform holds, read from Redis."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from lorafn.local.config import PlatformState
from lorafn.store import Keys, Store
from lorafn.store.backbones import get_backbone, list_backbones
from lorafn.store.registry import get_function, list_functions
from lorafn.store.stats import counters
from lorafn.store.workers import worker_ids, worker_info


@dataclass
class PlatformStatus:
    gateway_url: str
    redis_url: str
    backbones: list[tuple[str, str, str]] = field(default_factory=list)
    functions: list[dict[str, str]] = field(default_factory=list)
    workers: list[dict[str, str]] = field(default_factory=list)


def collect_status(state: PlatformState) -> PlatformStatus:
    store = Store(state.redis_url)
    keys = Keys(state.key_prefix)
    out = PlatformStatus(state.gateway_url, state.redis_url)
    try:
        for name in store.run(list_backbones(keys)):
            record = store.run(get_backbone(keys, name))
            if record is not None:
                out.backbones.append((name, record.dtype, record.model_dir))
        ids = store.run(worker_ids(keys))
        info = store.run(worker_info(keys, ids)) if ids else {}
        out.workers = [{"id": wid, **fields} for wid, fields in sorted(info.items())]
        for function in store.run(list_functions(keys)):
            record = store.run(get_function(keys, function))
            if record is None:
                continue
            stats = store.run(counters(keys, function))
            bound = sum(1 for w in out.workers if w.get("function") == function)
            out.functions.append(
                {
                    "function": function,
                    "backbone": str(record.spec.get("backbone", "")),
                    "workers": str(bound),
                    "auth": "public" if record.public else "api keys",
                    "requests": str(stats.get("requests", 0)),
                    "cold_starts": str(stats.get("cold_starts", 0)),
                    "errors": str(stats.get("errors", 0)),
                }
            )
    finally:
        store.close()
    return out


def render_status(status: PlatformStatus, console: Console | None = None) -> None:
    console = console or Console()
    console.print(f"gateway [bold]{status.gateway_url}[/]   redis {status.redis_url}")
    backbones = Table("backbone", "dtype", "model dir", title="Backbones")
    for row in status.backbones:
        backbones.add_row(*row)
    console.print(backbones)
    functions = Table(
        "function", "backbone", "workers", "auth", "requests", "cold starts", "errors", title="Functions"
    )
    for fn in status.functions:
        functions.add_row(
            fn["function"],
            fn["backbone"],
            fn["workers"],
            fn["auth"],
            fn["requests"],
            fn["cold_starts"],
            fn["errors"],
        )
    console.print(functions)
    workers = Table("worker", "function", "state", "pid", title="Workers")
    for w in status.workers:
        workers.add_row(w["id"], w.get("function", ""), w.get("state", ""), w.get("pid", ""))
    console.print(workers)
