"""`lorafn model ...`: real and random model directories.

Heavy imports (torch, transformers) happen inside the commands so that `lorafn --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="Get model directories: pull a real small model, or write random weights of real shapes.",
    no_args_is_help=True,
)


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code=2)


@app.command("pull")
def pull(
    name: str = typer.Argument(..., help="Model to pull. Known: smollm2-135m (SmolLM2-135M-Instruct)."),
    out: Path = typer.Option(
        None, "--out", help="Directory to write the model to. Without it, print the cached directory."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a model directory already at --out."),
    verify: bool = typer.Option(
        True,
        "--verify/--no-verify",
        help="After converting, check a greedy answer (capital of France → Paris).",
    ),
) -> None:
    """Fetch a real small model, convert it to safetensors and cache it (~/.cache/lorafn/models/).

    The cache directory can be moved with the environment variable LORAFN_CACHE_DIR. A second pull is
    instant: it copies (or just points to) the cached directory.
    """
    from lorafn.models._outdir import AssetError
    from lorafn.models.pull import pull_model

    try:
        path = pull_model(name, out=out, overwrite=overwrite, verify=verify, progress=True)
    except AssetError as e:
        _fail(str(e))
    typer.echo(str(path))


@app.command("random")
def random_model(
    preset: str = typer.Option(..., "--preset", help="tiny | llama-2-7b | llama-3-8b"),
    out: Path = typer.Option(..., "--out", help="Directory to write (new or empty)."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same bytes."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
    max_shard_gb: float = typer.Option(2.0, "--max-shard-gb", help="Largest safetensors shard, in GB."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a model directory already at --out."),
) -> None:
    """Write a Llama model with random weights of real shapes (config, sharded safetensors, tokenizer).

    tiny: a few-MB Llama for tests (GQA 4/2 heads, 4 layers, hidden 128, vocab 1024).
    llama-2-7b, llama-3-8b: the published configs of those models (13.5 / 16.1 GB in bfloat16).
    """
    from lorafn.models._outdir import AssetError
    from lorafn.models.random_model import write_random_model

    try:
        path = write_random_model(
            preset, out, seed=seed, dtype=dtype, max_shard_bytes=int(max_shard_gb * 1e9), overwrite=overwrite
        )
    except AssetError as e:
        _fail(str(e))
    typer.echo(str(path))


@app.command("presets")
def presets() -> None:
    """List the random-model presets with their shapes."""
    from lorafn.models.random_model import PRESETS, tensor_specs

    for p in PRESETS.values():
        params = sum(_prod(s) for _, s in tensor_specs(p))
        typer.echo(
            f"{p.name:12s} hidden={p.hidden_size} intermediate={p.intermediate_size} "
            f"heads={p.num_attention_heads} kv_heads={p.num_key_value_heads} layers={p.num_hidden_layers} "
            f"vocab={p.vocab_size} rope_theta={p.rope_theta:g} params={params / 1e9:.3f}B  ({p.source})"
        )


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
