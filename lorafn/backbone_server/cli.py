"""`lorafn backbone-server ...`: run a backbone server, ask one for its state, check a model directory."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer

app = typer.Typer(
    help="The backbone server: one read-only copy of a base model per GPU (or in shared memory).",
    no_args_is_help=True,
)


@app.command("serve")
def serve(
    model: Path = typer.Option(
        ..., "--model", help="Model directory: config.json + safetensors (sharded or not)."
    ),
    socket_path: Path = typer.Option(..., "--socket", help="Unix socket path workers connect to."),
    device: str = typer.Option("cpu", help="'cpu' (shared memory) or 'cuda' / 'cuda:N' (VMM on that GPU)."),
    http_host: str = typer.Option("127.0.0.1", help="Address of /healthz, /readyz, /metrics."),
    http_port: int = typer.Option(-1, help="Port of /healthz, /readyz, /metrics (0: any free; -1: none)."),
    lease_ttl: float = typer.Option(15.0, help="Seconds without a heartbeat before a lease expires."),
    heartbeat_interval: float = typer.Option(3.0, help="Heartbeat interval asked of workers, seconds."),
    max_workers: int = typer.Option(0, help="Refuse attaches beyond this many leases (0: no limit)."),
    w_addr: str = typer.Option(hex(0x1000_0000_0000), help="Fixed virtual address of W in workers (GPU)."),
    segment_mib: int = typer.Option(4096, help="Largest VMM allocation, MiB (0: one allocation)."),
    chunk_mib: int = typer.Option(64, help="Pinned staging buffer size, MiB (two per stream)."),
    streams: int = typer.Option(4, help="Loader threads/streams on GPU."),
    load_threads: int = typer.Option(4, help="Reader threads on CPU."),
    loader: str = typer.Option(
        "auto", help="GPU loading: hostreg (DMA from the page cache), staging (pinned buffers), auto."
    ),
    full_hash: bool = typer.Option(
        False, help="Hash every byte (default: config + safetensors headers + sizes)."
    ),
    log_level: str = typer.Option("INFO", help="Logging level."),
) -> None:
    """Load MODEL once and serve it to workers until SIGTERM."""
    from lorafn.backbone_server.server import BackboneServer, ServerConfig

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = ServerConfig(
        model_dir=model,
        socket_path=socket_path,
        device=device,
        http_host=http_host,
        http_port=None if http_port < 0 else http_port,
        lease_ttl_s=lease_ttl,
        heartbeat_interval_s=heartbeat_interval,
        max_workers=max_workers,
        w_addr=int(w_addr, 0),
        segment_bytes=segment_mib << 20,
        chunk_bytes=chunk_mib << 20,
        num_streams=streams,
        load_threads=load_threads,
        loader=loader,
        full_hash=full_hash,
    )
    from lorafn.backbone_server.manifest import ModelDirError

    try:
        BackboneServer(cfg).run()
    except ModelDirError as exc:
        typer.echo(f"error: cannot serve {model}: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command("stats")
def stats(socket_path: Path = typer.Option(..., "--socket", help="The server's Unix socket.")) -> None:
    """Print the server's state (load figures, leases) as JSON."""
    import socket

    from lorafn.backbone_server import protocol as proto

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(socket_path))
        reply, _ = proto.request(s, "stats")
    typer.echo(json.dumps(reply["stats"], indent=2))


@app.command("check")
def check(model: Path = typer.Argument(..., help="Model directory to check.")) -> None:
    """Check a model directory (config, index, every safetensors header) without loading it."""
    from lorafn.backbone_server.manifest import ModelDirError, content_hash, open_model_dir

    try:
        m = open_model_dir(model)
    except ModelDirError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(
        json.dumps(
            {
                "files": [str(f.file) for f in m.files],
                "tensors": len(m.tensors),
                "bytes": m.total_bytes,
                "content_hash": content_hash(m),
            },
            indent=2,
        )
    )


if __name__ == "__main__":  # `python -m lorafn.backbone_server.cli serve ...` (no other component's imports)
    app()
