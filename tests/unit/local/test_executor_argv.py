"""Every worker the local executor starts gets a KV budget on its command line, so its engine sizes the
KV cache from it (no profiling forward at start, issue 11 item 3), and the same command line goes to
the zygote as to a plain spawn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from lorafn.api.sizing import MiB
from lorafn.controller.policy.actions import Start
from lorafn.local.executor import LocalExecutor
from lorafn.local.procs import Child, Forker
from lorafn.runtime.worker import WorkerSettings


class _Recorded:
    pid = 4242

    def poll(self) -> int | None:
        return None


class RecordingGroup:
    """Takes the place of ProcessGroup: records what would be started."""

    def __init__(self) -> None:
        self.started: list[tuple[str, list[str], Forker | None]] = []
        self.children: dict[str, Child] = {}

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, fork: Forker | None = None
    ) -> Child:
        self.started.append((name, list(argv), fork))
        return Child(name=name, argv=list(argv), log_path=Path("/dev/null"), proc=_Recorded())  # type: ignore[arg-type]


def _executor(group: RecordingGroup, budget_bytes: int) -> LocalExecutor:
    return LocalExecutor(
        group,  # type: ignore[arg-type]
        "cpu",
        env=dict,
        backbone_socket=lambda _b, _g: None,
        backbone_bytes=lambda _b: 0,
        resident=lambda _g: [],
        kv_budget=lambda _a: budget_bytes,
    )


def _settings(argv: list[str]) -> WorkerSettings:
    """The worker's settings from the command line, parsed by `lorafn worker serve`'s own command."""
    import typer.main

    from lorafn.runtime.worker import app

    serve = typer.main.get_command(app)
    if hasattr(serve, "commands"):  # a group; typer collapses a one-command app into that command
        serve = serve.commands["serve"]
    args = argv[argv.index("serve") + 1 :]
    params = serve.make_context("serve", args).params
    return WorkerSettings(**{k: v for k, v in params.items() if v is not None})


@pytest.mark.parametrize("function", ["t/echo", None])
@pytest.mark.parametrize("budget_bytes", [64 * MiB, 3 * MiB + 5, 10])
def test_every_worker_gets_its_kv_budget(function: str | None, budget_bytes: int) -> None:
    group = RecordingGroup()
    action = Start(gpu="local/0", backbone="tiny", shape=None, function=function, mem_bytes=MiB, reason="t")
    _executor(group, budget_bytes).start(action, "w1")
    ((_name, argv, _fork),) = group.started
    settings = _settings(argv)
    assert settings.kv_budget_mib == max(1, budget_bytes // MiB)
    assert settings.standby == (function is None)
