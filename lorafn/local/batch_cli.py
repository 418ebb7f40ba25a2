"""`lorafn batch create|get|cancel|results`: offline batches through a gateway's OpenAI Batch API
(docs/batch.md), with the official `openai` client. The gateway is `--url` (env LORAFN_GATEWAY_URL), or
the one `lorafn up` runs (its platform.json); the key is the function's (`--api-key`, env LORAFN_API_KEY).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import typer

from lorafn.local.config import PlatformState, default_state_dir

app = typer.Typer(help="Offline batch jobs on a function (the OpenAI Batch API).", no_args_is_help=True)

_URL = typer.Option(None, "--url", envvar="LORAFN_GATEWAY_URL", help="Gateway URL (default: lorafn up's).")
_KEY = typer.Option(
    ..., "--api-key", envvar="LORAFN_API_KEY", help="The function's API key (env LORAFN_API_KEY)."
)
_FINAL = ("completed", "failed", "expired", "cancelled")


def _client(url: str | None, api_key: str) -> Any:
    import openai

    if not url:
        state_dir = Path(os.environ.get("LORAFN_STATE_DIR") or default_state_dir())
        try:
            url = PlatformState.read(state_dir).gateway_url
        except ValueError as e:
            raise _fail(f"no --url and no local platform: {e}") from None
    return openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key=api_key, max_retries=2)


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    import openai

    try:
        return fn(*args, **kwargs)
    except openai.APIStatusError as e:
        raise _fail(f"{e.status_code}: {e.message}") from None
    except openai.APIConnectionError as e:
        raise _fail(f"gateway unreachable: {e}") from None


def _show(batch: Any) -> None:
    typer.echo(json.dumps(batch.model_dump(), indent=2))


def wait_for(client: Any, batch_id: str, poll_s: float = 0.5) -> Any:
    """Poll until the batch ends, with a progress bar of answered requests."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    batch = _call(client.batches.retrieve, batch_id)
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    ) as bar:
        task = bar.add_task(batch.status, total=batch.request_counts.total or None)
        while True:
            counts = batch.request_counts
            bar.update(task, completed=counts.completed + counts.failed, description=batch.status)
            if batch.status in _FINAL:
                return batch
            time.sleep(poll_s)
            batch = _call(client.batches.retrieve, batch_id)


@app.command()
def create(
    input_file: Path = typer.Argument(
        ..., exists=True, dir_okay=False, help="JSONL of requests (OpenAI format)"
    ),
    endpoint: str = typer.Option(
        "/v1/chat/completions", "--endpoint", help="/v1/completions or /v1/chat/completions"
    ),
    wait: bool = typer.Option(False, "--wait", help="Show progress until the batch ends."),
    url: str | None = _URL,
    api_key: str = _KEY,
) -> None:
    """Upload INPUT_FILE and start a batch over it; prints the batch (or, with --wait, its end)."""
    client = _client(url, api_key)
    with input_file.open("rb") as f:
        uploaded = _call(client.files.create, file=(input_file.name, f), purpose="batch")
    batch = _call(
        client.batches.create, input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h"
    )
    if wait:
        batch = wait_for(client, batch.id)
    _show(batch)


@app.command()
def get(batch_id: str, url: str | None = _URL, api_key: str = _KEY) -> None:
    """The batch object: status, request_counts, output and error file ids."""
    _show(_call(_client(url, api_key).batches.retrieve, batch_id))


@app.command()
def cancel(batch_id: str, url: str | None = _URL, api_key: str = _KEY) -> None:
    """Stop a batch: nothing more is submitted; what did not run is recorded as cancelled."""
    _show(_call(_client(url, api_key).batches.cancel, batch_id))


@app.command()
def results(
    batch_id: str,
    errors: bool = typer.Option(False, "--errors", help="The error file instead of the output file."),
    out: Path | None = typer.Option(None, "--out", help="Write here instead of standard output."),
    url: str | None = _URL,
    api_key: str = _KEY,
) -> None:
    """The output (or error) file of a finished batch, as JSONL."""
    client = _client(url, api_key)
    batch = _call(client.batches.retrieve, batch_id)
    file_id = batch.error_file_id if errors else batch.output_file_id
    if file_id is None:
        if batch.status not in _FINAL:
            raise _fail(f"batch {batch_id} is {batch.status}: its files are written when it ends")
        raise _fail(f"batch {batch_id} has no {'error' if errors else 'output'} file (no such lines)")
    data = _call(client.files.content, file_id).content
    if out is None:
        typer.echo(data.decode(), nl=False)
    else:
        out.write_bytes(data)
        typer.echo(f"{len(data)} bytes -> {out}", err=True)
