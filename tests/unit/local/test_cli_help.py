"""Help of every command: flags show as flags (no `<bool>` placeholder), local-mode commands exist."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from lorafn.cli import app

runner = CliRunner()


def _paths(group: object, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, cmd in group.commands.items():  # type: ignore[attr-defined]
        out.append((*prefix, name))
        if getattr(cmd, "commands", None):
            out += _paths(cmd, (*prefix, name))
    return out


ALL = [(), *_paths(typer.main.get_command(app))]


@pytest.mark.parametrize("path", ALL, ids=lambda p: " ".join(p) or "lorafn")
def test_help_has_no_bool_placeholders(path: tuple[str, ...]) -> None:
    res = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "<bool>" not in res.output


def test_local_lifecycle_commands_exist() -> None:
    assert {
        ("up",),
        ("down",),
        ("apply",),
        ("get",),
        ("delete",),
        ("logs",),
        ("invoke",),
        ("status",),
    } <= set(ALL)
    res = runner.invoke(app, ["up", "--help"], env={"COLUMNS": "200"})
    for flag in ("--detach", "--host", "--log-level", "--port", "--state-dir"):
        assert flag in res.output
