"""`lorafn model ...`: real and random model directories."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="Get model directories: pull a real small model, or write random weights of real shapes.",
    no_args_is_help=True,
)
