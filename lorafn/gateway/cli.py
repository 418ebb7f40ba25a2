"""`lorafn gateway serve`: the HTTP gateway as a process (uvicorn).

Configuration: `GatewaySettings` (environment variables `LORAFN_*`); command-line options override.
"""

from __future__ import annotations

import typer

app = typer.Typer(help="Run the HTTP gateway (OpenAI-compatible + native invocation).", no_args_is_help=True)


@app.command("serve")
def serve(
    host: str = typer.Option(None, "--host", help="env LORAFN_HOST (default 127.0.0.1)"),
    port: int = typer.Option(None, "--port", help="env LORAFN_PORT (default 8080; 0 picks a free one)"),
    redis_url: str = typer.Option(None, "--redis-url", help="env LORAFN_REDIS_URL"),
    key_prefix: str = typer.Option(None, "--key-prefix", help="env LORAFN_KEY_PREFIX (default lorafn)"),
) -> None:
    """Serve the HTTP API until SIGINT/SIGTERM."""
    import logging

    import uvicorn

    from lorafn.gateway.app import create_app
    from lorafn.gateway.server import uvicorn_config
    from lorafn.gateway.settings import GatewaySettings

    overrides = {k: v for k, v in locals().items() if v is not None and k not in ("uvicorn",)}
    settings = GatewaySettings(**{k: v for k, v in overrides.items() if k in GatewaySettings.model_fields})
    # the gateway's own lines (one per request, warnings) at the configured level; uvicorn's loggers
    # keep their own handlers
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    uvicorn.Server(uvicorn_config(create_app(settings), settings)).run()
