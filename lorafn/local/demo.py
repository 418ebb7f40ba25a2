"""`lorafn up --demo`: SmolLM2 with the example adapters, invoked through the real gateway.

It pulls SmolLM2-135M-Instruct (cached after the first time), writes a YAML file with a Backbone, the
example LoRAFunctions and a Secret holding fresh API keys, applies it exactly as `lorafn apply -f`
would, then calls each function twice with the official `openai` client, streaming: the first call
is a cold start (no worker yet), the second a warm one. It prints time to first token for both and the
answers side by side, so the adapters' effect is visible.
"""

from __future__ import annotations

import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from lorafn.local.apply import apply_manifest
from lorafn.local.manifests import parse_manifest
from lorafn.local.platform import LocalPlatform
from lorafn.local.procs import child_env, lorafn_argv
from lorafn.local.redis_proc import write_private

NAMESPACE = "demo"
BACKBONE = "smollm2-135m"
# (function name, adapter directory under examples/adapters, prompts)
DEMO_FUNCTIONS: list[tuple[str, str, list[str]]] = [
    ("french", "french", ["What is the capital of Italy?", "Name a fruit that is yellow."]),
    (
        "gsm8k",
        "gsm8k-format",
        ["Tom has 3 boxes with 4 apples each. He eats 2 apples. How many apples are left?"],
    ),
]


def examples_dir() -> Path:
    """examples/ of the source tree this package runs from (the demo needs a clone, not a wheel)."""
    here = Path(__file__).resolve().parents[2] / "examples" / "adapters"
    if not here.is_dir():
        raise RuntimeError(f"the demo needs the example adapters at {here}: run it from a clone of lorafn")
    return here


def pull_model(state_dir: Path) -> Path:
    out = state_dir / "models" / BACKBONE
    # The pull shows its own progress bar; a cached model makes this instant. `--overwrite`: the directory is
    # the demo's own, and an earlier demo left the model there (without it a second `lorafn up --demo` on the
    # same state dir stopped at "already holds a model directory"); the files are placed again from the
    # cache (links), so a backbone server still reading the old ones keeps them.
    subprocess.run(
        lorafn_argv("model", "pull", "smollm2-135m", "--out", str(out), "--overwrite"),
        check=True,
        env=child_env(),
    )
    return out


def demo_manifest(model_dir: Path, adapters: Path, keys: dict[str, str]) -> str:
    docs: list[dict[str, object]] = [
        {
            "apiVersion": "lorafn.io/v1alpha1",
            "kind": "Backbone",
            "metadata": {"name": BACKBONE},
            "spec": {"model": {"uri": f"file://{model_dir}"}, "dtype": "float32"},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "demo-keys", "namespace": NAMESPACE},
            "stringData": {name: key for name, key in keys.items()},
        },
    ]
    for name, adapter, _ in DEMO_FUNCTIONS:
        docs.append(
            {
                "apiVersion": "lorafn.io/v1alpha1",
                "kind": "LoRAFunction",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {
                    "backbone": BACKBONE,
                    "adapter": {"uri": f"file://{adapters / adapter}"},
                    "slo": {"ttftMs": 2000},
                    "scaling": {"minReplicas": 0, "maxReplicas": 1, "keepAliveSeconds": 300},
                    "generation": {"maxTokens": 48, "temperature": 0.0},
                    "auth": {"apiKeySecretRef": {"name": "demo-keys", "key": name}},
                },
            }
        )
    return yaml.safe_dump_all(docs, sort_keys=False)


@dataclass
class Call:
    function: str
    prompt: str
    kind: str
    ttft_ms: float | None
    total_ms: float
    text: str
    error: str | None = None


def _call(base_url: str, api_key: str, function: str, prompt: str, kind: str) -> Call:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=300)
    started = time.perf_counter()
    first = None
    pieces: list[str] = []
    try:
        stream = client.chat.completions.create(
            model=function,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=48,
            temperature=0.0,
            stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = (time.perf_counter() - started) * 1000
                pieces.append(chunk.choices[0].delta.content)
    except openai.OpenAIError as exc:
        return Call(function, prompt, kind, first, (time.perf_counter() - started) * 1000, "", str(exc))
    return Call(function, prompt, kind, first, (time.perf_counter() - started) * 1000, "".join(pieces))


def write_demo_manifest(state_dir: Path, text: str) -> Path:
    """`<state dir>/demo.yaml`, 0600: its Secret holds the demo functions' API keys (issue 15)."""
    path = state_dir / "demo.yaml"
    write_private(path, text)
    return path


def run_demo(platform: LocalPlatform, console: Console | None = None) -> bool:
    """Run the demo against a started platform; True when every invocation returned text."""
    console = console or Console()
    assert platform.store is not None
    console.rule("lorafn demo")
    model_dir = pull_model(platform.state_dir)
    keys = {name: f"lfn-{secrets.token_urlsafe(24)}" for name, _, _ in DEMO_FUNCTIONS}
    text = demo_manifest(model_dir, examples_dir(), keys)
    manifest_path = write_demo_manifest(platform.state_dir, text)
    for item in apply_manifest(platform.store, platform.keys, parse_manifest(text)):
        console.print(item.line())
    console.print(f"(the YAML applied is in {manifest_path}; its Secret holds the demo's API keys)")
    platform.sync_backbones()

    calls: list[Call] = []
    for name, _, prompts in DEMO_FUNCTIONS:
        function = f"{NAMESPACE}/{name}"
        for index, prompt in enumerate(prompts * 2 if len(prompts) == 1 else prompts):
            kind = "cold" if index == 0 else "warm"
            # The supervisor must run while the gateway waits for a worker: call from a thread.
            calls.append(_call_with_supervisor(platform, keys[name], function, prompt, kind))
    table = Table("function", "start", "TTFT ms", "total ms", "answer", title="Invocations (openai client)")
    for c in calls:
        table.add_row(
            c.function,
            c.kind,
            f"{c.ttft_ms:.0f}" if c.ttft_ms is not None else "-",
            f"{c.total_ms:.0f}",
            c.text.strip() if c.error is None else f"[red]error: {c.error}[/]",
        )
    console.print(table)
    ok = all(c.error is None and c.text.strip() for c in calls)
    console.print("[green]all invocations succeeded[/]" if ok else "[red]some invocations failed[/]")
    return ok


def _call_with_supervisor(
    platform: LocalPlatform, api_key: str, function: str, prompt: str, kind: str
) -> Call:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(_call, platform.gateway_url, api_key, function, prompt, kind)
        while not future.done():
            platform.tick(block_ms=100)
        return future.result()
