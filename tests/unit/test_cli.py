"""The `lorafn` command: --help and --version, --help of every command, model commands' errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from lorafn import __version__
from lorafn.cli import app

runner = CliRunner()


def _command_paths(group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    # typer vendors its own click: recognise groups by their `commands`, not by click.Group.
    paths = []
    for name, cmd in group.commands.items():
        paths.append((*prefix, name))
        if getattr(cmd, "commands", None):
            paths += _command_paths(cmd, (*prefix, name))
    return paths


ALL_COMMANDS = _command_paths(typer.main.get_command(app))


def test_help_lists_the_commands() -> None:
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0, res.output
    assert "model" in res.output


def test_a_typer_without_the_help_hook_still_runs_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag-placeholder patch is cosmetic: on a typer without TyperOption.display_type_rich (the GPU
    image's typer, within pyproject's >= 0.12) it steps aside instead of failing every command at import."""
    import typer.core

    from lorafn.cli import _no_flag_placeholders

    older = type("TyperOption", (), {"is_flag": False})  # an option class of a typer without the hook
    monkeypatch.setattr(typer.core, "TyperOption", older)
    _no_flag_placeholders()
    assert not hasattr(older, "display_type_rich")


def test_version() -> None:
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0
    assert res.output.strip() == f"lorafn {__version__}"


def test_the_installed_entry_point_runs() -> None:
    res = subprocess.run([sys.executable, "-m", "lorafn.cli", "--version"], capture_output=True, text=True)
    assert res.returncode == 0 and __version__ in res.stdout


def test_model_commands_exist() -> None:
    assert {("model",), ("model", "pull"), ("model", "random"), ("model", "presets")} <= set(ALL_COMMANDS)


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=lambda p: " ".join(p))
def test_every_command_has_help(path: tuple[str, ...]) -> None:
    res = runner.invoke(app, [*path, "--help"])
    assert res.exit_code == 0, res.output
    assert "Usage:" in res.output


def test_model_random_writes_a_tiny_model(tmp_path: Path) -> None:
    res = runner.invoke(
        app, ["model", "random", "--preset", "tiny", "--out", str(tmp_path / "m"), "--seed", "1"]
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "m" / "config.json").exists()
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--preset", "tiny", "--dtype", "int4"], "unknown dtype 'int4'"),
    ],
)
def test_model_random_errors_are_one_clear_line(tmp_path: Path, args: list[str], message: str) -> None:
    res = runner.invoke(app, ["model", "random", "--out", str(tmp_path / "m"), *args])
    assert res.exit_code == 2
    assert f"error: {message}" in res.output
    assert "Traceback" not in res.output


def test_model_pull_refuses_a_file_as_out(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    res = runner.invoke(app, ["model", "pull", "smollm2-135m", "--out", str(tmp_path / "f")])
    assert res.exit_code == 2
    assert "is a file, not a directory" in res.output


def test_model_pull_unknown_model(tmp_path: Path) -> None:
    res = runner.invoke(app, ["model", "pull", "llama-70b", "--out", str(tmp_path / "m")])
    assert res.exit_code == 2
    assert "unknown model 'llama-70b'; known: smollm2-135m" in res.output


def test_model_presets_lists_real_shapes() -> None:
    res = runner.invoke(app, ["model", "presets"])
    assert res.exit_code == 0
    assert "llama-3-8b" in res.output and "rope_theta=500000" in res.output and "params=8.030B" in res.output
