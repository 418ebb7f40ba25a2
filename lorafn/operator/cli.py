"""`lorafn operator ...`: run the Kubernetes operator, print its CRDs."""

from __future__ import annotations

import typer

app = typer.Typer(help="The Kubernetes operator (Backbone and LoRAFunction resources).", no_args_is_help=True)


@app.command("run")
def run(
    namespace: list[str] = typer.Option(
        [], "--namespace", "-n", help="Watch LoRAFunctions only in these namespaces (default: all)."
    ),
    liveness: str = typer.Option(
        "http://0.0.0.0:8080/healthz", help="URL of the liveness endpoint kopf serves ('' to disable)."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Run the operator until interrupted (in the cluster: the chart's operator Deployment)."""
    import asyncio
    import logging

    import kopf

    import lorafn.operator.handlers  # noqa: F401  (registers the handlers)

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO)
    for noisy in ("httpx", "httpcore"):  # one line per API call otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # One replica at a time (the Deployment uses strategy Recreate): no kopf peering objects needed.
    asyncio.run(
        kopf.operator(
            standalone=True,
            clusterwide=not namespace,
            namespaces=tuple(namespace),
            liveness_endpoint=liveness or None,
        )
    )


@app.command("crds")
def crds() -> None:
    """Print both CustomResourceDefinitions as YAML (generated from the pydantic specs)."""
    from lorafn.operator.crds import build_crds, render_yaml

    typer.echo("---\n".join(render_yaml(crd) for crd in build_crds()), nl=False)
