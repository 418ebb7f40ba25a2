"""The `lorafn` command. Each component owns its own sub-command module; this file only composes them.

Sub-command modules import their heavy dependencies (torch, transformers, redis) inside the commands,
so `lorafn --help` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

import typer

from lorafn import __version__

app = typer.Typer(
    name="lorafn",
    help="Serverless LoRA functions: one shared backbone per GPU, cold starts that feel warm.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# (module, attribute, name): each attribute is a typer.Typer added as a group, or None to register
# the module's commands on the root app through its `register(app)` function.
_GROUPS: list[tuple[str, str, str | None]] = [
    ("lorafn.models.cli", "app", "model"),
    ("lorafn.gateway.cli", "app", "gateway"),
    ("lorafn.runtime.worker", "app", "worker"),
    ("lorafn.operator.cli", "app", "operator"),
    ("lorafn.controller.cli", "app", "controller"),
    ("lorafn.backbone_server.cli", "app", "backbone-server"),
    ("lorafn.replay.cli", "app", "bench"),
    ("lorafn.runtime.zygote", "app", "zygote"),
    ("lorafn.local.batch_cli", "app", "batch"),
]
_ROOT_REGISTRARS: list[str] = ["lorafn.local.cli"]


def _no_flag_placeholders() -> None:
    """Help shows `--demo` as a flag, not `--demo <bool>`: typer prints a type for every option, flags
    included, and a flag takes no value. One patch here covers every sub-command and `--help` itself."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None:  # an older typer (the GPU image's) has no such hook: its help keeps the placeholder
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_no_flag_placeholders()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lorafn {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """lorafn: serverless LoRA functions on Kubernetes GPUs."""


def _compose() -> None:
    for module_name, attr, name in _GROUPS:
        module = importlib.import_module(module_name)
        app.add_typer(getattr(module, attr), name=name)
    for module_name in _ROOT_REGISTRARS:
        importlib.import_module(module_name).register(app)


_compose()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
