"""Root commands of local mode: `lorafn up`, `lorafn apply`, `lorafn invoke`, `lorafn status`."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import typer

from lorafn.local.config import PlatformState, default_state_dir, load_config

_STATE_DIR_OPTION = typer.Option(
    None, "--state-dir", help="Where the platform keeps Redis data, logs and sockets (env LORAFN_STATE_DIR)."
)


def _state_dir(given: Path | None) -> Path:
    return given or Path(os.environ.get("LORAFN_STATE_DIR") or default_state_dir())


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def up(
    config: Path | None = typer.Option(None, "--config", help="YAML file of LocalConfig settings."),
    state_dir: Path | None = _STATE_DIR_OPTION,
    port: int | None = typer.Option(None, "--port", help="Gateway port (default 8080; 0: any free)."),
    device: str | None = typer.Option(None, "--device", help="auto | cpu | cuda"),
    demo: bool = typer.Option(
        False, "--demo", help="Pull SmolLM2, register the example functions, invoke them."
    ),
    once: bool = typer.Option(
        False, "--once", help="With --demo: exit after the demo (0 only if all succeeded)."
    ),
) -> None:
    """Run the whole platform on this machine: redis-server, backbone servers, gateway, workers."""
    from lorafn.local.platform import LocalPlatform

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(config, {"state_dir": state_dir, "gateway_port": port, "device": device})
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if once and not demo:
        raise _fail("--once only makes sense with --demo")
    platform = LocalPlatform(cfg)

    def _on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    ok = True
    try:
        state = platform.start()
        typer.secho(
            f"lorafn is up: gateway {state.gateway_url}, redis {state.redis_url}", fg=typer.colors.GREEN
        )
        typer.echo(f"state and logs in {cfg.state_dir}; Ctrl-C stops everything")
        if demo:
            from lorafn.local.demo import run_demo

            ok = run_demo(platform)
            if once:
                return
        platform.serve_forever()
    except KeyboardInterrupt:
        typer.echo("\nstopping...")
    except (RuntimeError, TimeoutError, ValueError) as exc:
        ok = False
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    finally:
        platform.stop()
    if not ok:
        raise typer.Exit(1)


def apply(
    file: Path = typer.Option(
        ..., "-f", "--filename", help="YAML with Backbone, LoRAFunction and Secret objects."
    ),
    api_key: list[str] = typer.Option(
        [], "--api-key", help="An API key for every function in the file (repeatable)."
    ),
    no_auth: bool = typer.Option(
        False, "--no-auth", help="Make the functions public (no API key). Loudly unsafe."
    ),
    state_dir: Path | None = _STATE_DIR_OPTION,
) -> None:
    """Register Backbones and LoRAFunctions with the running local platform (same YAML as kubectl apply)."""
    from lorafn.local.apply import apply_manifest, load_local_secrets
    from lorafn.local.manifests import ManifestError, parse_manifest
    from lorafn.store import Keys, Store

    sdir = _state_dir(state_dir)
    try:
        state = PlatformState.read(sdir)
        manifest = parse_manifest(file.read_text())
        if no_auth:
            typer.secho(
                "WARNING: --no-auth makes these functions PUBLIC: "
                "anyone who can reach the gateway can call them.",
                fg=typer.colors.YELLOW, bold=True, err=True,
            )  # fmt: skip
        store = Store(state.redis_url)
        applied = apply_manifest(
            store, Keys(state.key_prefix), manifest, load_local_secrets(sdir), list(api_key), no_auth
        )
    except FileNotFoundError:
        raise _fail(f"{file} does not exist") from None
    except (ManifestError, ValueError) as exc:
        raise _fail(str(exc)) from None
    for item in applied:
        typer.echo(f"{item.kind.lower()}/{item.name} configured ({item.detail})")


def invoke(
    function: str = typer.Argument(..., help="namespace/name"),
    prompt: str = typer.Argument(..., help="The user message."),
    stream: bool = typer.Option(False, "--stream", help="Print tokens as they arrive."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="LORAFN_API_KEY", help="env LORAFN_API_KEY"),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, max=2.0),
    raw: bool = typer.Option(
        False, "--raw", help="Send the prompt as a completion, without the chat template."
    ),
    state_dir: Path | None = _STATE_DIR_OPTION,
) -> None:
    """Call a function through the local gateway with the OpenAI client."""
    import openai

    from lorafn.api import FunctionRef

    try:
        ref = FunctionRef.parse(function)
        state = PlatformState.read(_state_dir(state_dir))
    except ValueError as exc:
        raise _fail(str(exc)) from None
    client = openai.OpenAI(base_url=f"{state.gateway_url}/v1", api_key=api_key or "none", max_retries=0)
    started = time.perf_counter()
    first: float | None = None
    try:
        if raw:
            result = client.completions.create(
                model=str(ref), prompt=prompt, max_tokens=max_tokens, temperature=temperature, stream=stream
            )
        else:
            result = client.chat.completions.create(
                model=str(ref),
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=temperature,
                stream=stream,
            )
        if stream:
            for chunk in result:
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                piece = choice.text if raw else (choice.delta.content or "")
                if piece and first is None:
                    first = time.perf_counter() - started
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            choice = result.choices[0]
            typer.echo(choice.text if raw else choice.message.content)
    except openai.APIStatusError as exc:
        raise _fail(f"{exc.status_code}: {exc.message}") from None
    except openai.APIConnectionError:
        raise _fail(f"cannot reach the gateway at {state.gateway_url}; is `lorafn up` running?") from None
    total = time.perf_counter() - started
    ttft = f"TTFT {first * 1000:.0f} ms, " if first is not None else ""
    typer.secho(f"[{ttft}total {total * 1000:.0f} ms]", fg=typer.colors.BRIGHT_BLACK, err=True)


def status(state_dir: Path | None = _STATE_DIR_OPTION) -> None:
    """Show the running platform: backbones, functions, workers, request counters."""
    from lorafn.local.status import collect_status, render_status

    try:
        state = PlatformState.read(_state_dir(state_dir))
    except ValueError as exc:
        raise _fail(str(exc)) from None
    render_status(collect_status(state))


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("apply")(apply)
    app.command("invoke")(invoke)
    app.command("status")(status)
