"""Root commands of local mode: `lorafn up`, `lorafn apply`, `lorafn invoke`, `lorafn status`."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import typer

from lorafn.local.config import LocalConfig, PlatformState, default_state_dir, load_config

_STATE_DIR_OPTION = typer.Option(
    None, "--state-dir", help="Where the platform keeps Redis data, logs and sockets (env LORAFN_STATE_DIR)."
)


def _state_dir(given: Path | None) -> Path:
    return given or Path(os.environ.get("LORAFN_STATE_DIR") or default_state_dir())


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Every HTTP call the demo and the supervisor make would be an INFO line between their output.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


_LOG_LEVELS = ("debug", "info", "warning", "error")


def up(
    config: Path | None = typer.Option(None, "--config", help="YAML file of LocalConfig settings."),
    state_dir: Path | None = _STATE_DIR_OPTION,
    host: str | None = typer.Option(
        None, "--host", help="Address the gateway listens on (default 127.0.0.1)."
    ),
    port: int | None = typer.Option(None, "--port", help="Gateway port (default 8080; 0: any free)."),
    device: str | None = typer.Option(None, "--device", help="auto | cpu | cuda"),
    detach: bool = typer.Option(
        False, "--detach", "-d", help="Start in the background and return; `lorafn down` stops it."
    ),
    log_level: str = typer.Option("info", "--log-level", help="debug | info | warning | error"),
    demo: bool = typer.Option(
        False, "--demo", help="Pull SmolLM2, register the example functions, invoke them."
    ),
    once: bool = typer.Option(
        False, "--once", help="With --demo: exit after the demo (0 only if all succeeded)."
    ),
) -> None:
    """Run the whole platform on this machine: redis-server, backbone servers, gateway, workers."""
    from lorafn.local.lifecycle import StateLock, check_port_free

    if log_level.lower() not in _LOG_LEVELS:
        raise _fail(f"--log-level {log_level!r}: choose one of {', '.join(_LOG_LEVELS)}")
    _setup_logging(log_level)
    try:
        cfg = load_config(
            config, {"state_dir": state_dir, "gateway_port": port, "device": device, "host": host}
        )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if once and not demo:
        raise _fail("--once only makes sense with --demo")
    if detach:
        if demo:
            raise _fail("--demo prints its results here: run it without --detach")
        _up_detached(config, cfg.state_dir, cfg.host, port, device, log_level)
        return
    try:
        lock = StateLock.acquire(cfg.state_dir)
    except ValueError as exc:
        raise _fail(str(exc), code=1) from None
    try:
        check_port_free(cfg.host, cfg.gateway_port)
        _run_platform(cfg, demo, once)
    except ValueError as exc:
        raise _fail(str(exc), code=1) from None
    finally:
        lock.release()


def _run_platform(cfg: LocalConfig, demo: bool, once: bool) -> None:
    from lorafn.local.platform import LocalPlatform

    platform = LocalPlatform(cfg)

    def _on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    # SIGUSR1: a fresh controller (as if its process had crashed and restarted); everything else runs on
    signal.signal(signal.SIGUSR1, lambda *_: platform.request_controller_restart("SIGUSR1"))
    ok = True
    try:
        state = platform.start()
        typer.secho(
            f"lorafn is up: gateway {state.gateway_url}, redis {state.shown_redis_url}", fg=typer.colors.GREEN
        )
        typer.echo(f"state and logs in {cfg.state_dir}; Ctrl-C (or `lorafn down`) stops everything")
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


def _up_detached(
    config: Path | None, sdir: Path, host: str, port: int | None, device: str | None, log_level: str
) -> None:
    from lorafn.local.lifecycle import check_port_free, owner, start_detached
    from lorafn.local.procs import child_env, lorafn_argv

    running = owner(sdir)
    if running is not None:
        raise _fail(
            f"state dir {sdir} is in use by a running `lorafn up` (pid {running}); "
            f"stop it with `lorafn down --state-dir {sdir}`",
            code=1,
        )
    argv = ["up", "--state-dir", str(sdir.resolve()), "--host", host, "--log-level", log_level]
    if config is not None:
        argv += ["--config", str(config.resolve())]
    if port is not None:
        try:
            check_port_free(host, port)
        except ValueError as exc:
            raise _fail(str(exc), code=1) from None
        argv += ["--port", str(port)]
    if device is not None:
        argv += ["--device", device]
    try:
        pid = start_detached(lorafn_argv(*argv), sdir, child_env(), timeout_s=300)
        state = PlatformState.read(sdir)
    except (RuntimeError, TimeoutError, ValueError) as exc:
        raise _fail(str(exc), code=1) from None
    typer.secho(
        f"lorafn is up in the background (pid {pid}): gateway {state.gateway_url}", fg=typer.colors.GREEN
    )
    typer.echo(f"logs: `lorafn logs up --state-dir {sdir}`; stop it with `lorafn down --state-dir {sdir}`")


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
        typer.echo(item.line())


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
    # No key: send no Authorization header at all, so the gateway's own message says what is missing.
    client = openai.OpenAI(base_url=f"{state.gateway_url}/v1", api_key=api_key or "unused", max_retries=0)
    auth_opts: dict[str, Any] = {} if api_key else {"extra_headers": {"Authorization": openai.Omit()}}
    started = time.perf_counter()
    first: float | None = None
    try:
        if raw:
            result = client.completions.create(
                model=str(ref),
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=temperature,
                stream=stream,
                **auth_opts,
            )
        else:
            result = client.chat.completions.create(
                model=str(ref),
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=temperature,
                stream=stream,
                **auth_opts,
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
    """Show the running platform: functions, warm pool, workers, backbones.

    Per function its phase, bound workers, queued requests, last cold start (ms and path: standby or
    fresh) and why it is not ready; the standby workers per device and adapter shape against the pool
    targets."""
    from lorafn.local.status import collect_status, render_status

    try:
        state = PlatformState.read(_state_dir(state_dir))
    except ValueError as exc:
        raise _fail(str(exc)) from None
    render_status(collect_status(state))


_KINDS = {
    "functions": "functions", "function": "functions", "lorafunctions": "functions",
    "lorafunction": "functions", "fn": "functions", "backbones": "backbones", "backbone": "backbones",
    "bb": "backbones",
}  # fmt: skip


def get(
    kind: str = typer.Argument(..., help="functions | backbones"),
    name: str | None = typer.Argument(None, help="Only this one (NAMESPACE/NAME or backbone name)."),
    output: str | None = typer.Option(None, "-o", "--output", help="yaml | json (default: a table)"),
    state_dir: Path | None = _STATE_DIR_OPTION,
) -> None:
    """List functions (rank, targets, phase, workers, last cold start, why waiting) or backbones.

    Columns as `lorafn status` shows them; -o yaml|json for scripts, like kubectl get."""
    from lorafn.local.status import collect_status, render_get

    resolved = _KINDS.get(kind.lower())
    if resolved is None:
        raise _fail(f"unknown resource type {kind!r}: use functions or backbones")
    if output not in (None, "yaml", "json"):
        raise _fail(f"-o {output!r}: use yaml or json")
    try:
        found = collect_status(PlatformState.read(_state_dir(state_dir)))
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if name is not None:
        found.functions = [f for f in found.functions if f.name == name]
        found.backbones = [b for b in found.backbones if b.name == name]
        if not (found.functions if resolved == "functions" else found.backbones):
            raise _fail(f'{resolved.removesuffix("s")} "{name}" not found', code=1)
    typer.echo(render_get(resolved, found, output).rstrip("\n"))


def delete(
    name: str | None = typer.Argument(None, help="NAMESPACE/NAME of a function."),
    file: Path | None = typer.Option(
        None, "-f", "--filename", help="Delete the Backbones and LoRAFunctions this YAML file names."
    ),
    ignore_not_found: bool = typer.Option(
        False, "--ignore-not-found", help="Treat objects that do not exist as deleted."
    ),
    state_dir: Path | None = _STATE_DIR_OPTION,
) -> None:
    """Unregister functions (their workers drain and stop) and unused backbones."""
    from lorafn.api import FunctionRef
    from lorafn.local.apply import delete_objects
    from lorafn.local.manifests import ManifestError, parse_manifest
    from lorafn.store import Keys, Store

    if (name is None) == (file is None):
        raise _fail("give either NAMESPACE/NAME or -f FILE")
    try:
        state = PlatformState.read(_state_dir(state_dir))
        if file is not None:
            manifest = parse_manifest(file.read_text())
            functions = [str(f.ref) for f in manifest.functions]
            backbones = [b.name for b in manifest.backbones]
        else:
            functions, backbones = [str(FunctionRef.parse(name or ""))], []
        store = Store(state.redis_url)
        try:
            deleted = delete_objects(store, Keys(state.key_prefix), functions, backbones, ignore_not_found)
        finally:
            store.close()
    except FileNotFoundError:
        raise _fail(f"{file} does not exist") from None
    except (ManifestError, ValueError) as exc:
        raise _fail(str(exc), code=1) from None
    for item in deleted:
        typer.echo(item.line())


def logs(
    target: str = typer.Argument(
        ..., help="NAMESPACE/NAME (its workers), gateway, backbone, backbone/NAME or up"
    ),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing what the logs append."),
    tail: int = typer.Option(-1, "--tail", help="Lines of each log to show first (-1: all)."),
    state_dir: Path | None = _STATE_DIR_OPTION,
) -> None:
    """Print the logs of a function's workers, the gateway, the backbone servers or a detached `up`."""
    from lorafn.local.logs import function_worker_ids, log_files, show
    from lorafn.store import Keys, Store

    sdir = _state_dir(state_dir)
    log_dir = sdir / "logs"
    store: Store | None = None

    def ids_of(function: str) -> list[str]:
        nonlocal store
        state = PlatformState.read(sdir)
        store = store or Store(state.redis_url)
        return function_worker_ids(store, Keys(state.key_prefix), function)

    try:
        files = log_files(log_dir, target, ids_of)
    except ValueError as exc:
        raise _fail(str(exc), code=1) from None
    is_function = "/" in target and not target.startswith("backbone/")
    refresh = (lambda: log_files(log_dir, target, ids_of)) if is_function else None
    try:
        show(files, tail=tail, follow=follow, refresh=refresh if follow else None)
    except KeyboardInterrupt:
        pass
    finally:
        if store is not None:
            store.close()


def down(
    state_dir: Path | None = _STATE_DIR_OPTION,
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds to wait for a clean stop."),
) -> None:
    """Stop the `lorafn up` that owns the state dir (workers drain first), and wait until it has."""
    from lorafn.local.lifecycle import stop_platform

    sdir = _state_dir(state_dir)
    try:
        pid = stop_platform(sdir, timeout_s=timeout)
    except (ValueError, TimeoutError) as exc:
        raise _fail(str(exc), code=1) from None
    typer.echo(f"lorafn (pid {pid}) stopped")


def register(app: typer.Typer) -> None:
    for name, command in (
        ("up", up), ("down", down), ("apply", apply), ("get", get), ("delete", delete), ("invoke", invoke),
        ("logs", logs), ("status", status),
    ):  # fmt: skip
        app.command(name)(command)
