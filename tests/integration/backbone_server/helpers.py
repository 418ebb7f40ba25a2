"""Helpers shared by the backbone-server tests (CPU integration and GPU): a model writer, a server
process and probe-worker processes (bench/_probe.py) speaking JSON lines."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def write_model(
    out: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    vocab: int = 256,
    dtype: str = "bfloat16",
    shards: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """A small Llama-shaped checkpoint with random weights; returns {name: tensor} as written."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    inter = hidden * 2
    ts: dict[str, Any] = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            ts[p + f"self_attn.{n}.weight"] = torch.randn(hidden, hidden, generator=g) * 0.05
        ts[p + "mlp.gate_proj.weight"] = torch.randn(inter, hidden, generator=g) * 0.05
        ts[p + "mlp.up_proj.weight"] = torch.randn(inter, hidden, generator=g) * 0.05
        ts[p + "mlp.down_proj.weight"] = torch.randn(hidden, inter, generator=g) * 0.05
        ts[p + "input_layernorm.weight"] = torch.ones(hidden) + torch.randn(hidden, generator=g) * 0.01
        ts[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    ts["model.norm.weight"] = torch.ones(hidden)
    ts["lm_head.weight"] = torch.randn(vocab, hidden, generator=g) * 0.05
    ts = {k: v.to(dt).contiguous() for k, v in ts.items()}
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "torch_dtype": dtype,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    (out / "config.json").write_text(json.dumps(config))
    names = list(ts)
    if shards == 1:
        save_file(ts, str(out / "model.safetensors"))
    else:
        per = -(-len(names) // shards)
        weight_map = {}
        for s in range(shards):
            part = names[s * per : (s + 1) * per]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: ts[k] for k in part}, str(out / fname))
            weight_map.update(dict.fromkeys(part, fname))
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    return ts


def file_digest(model_dir: Path) -> str:
    """The probe's digest of the tensors as the safetensors files store them."""
    from safetensors.torch import load_file

    from bench._probe import digest

    tensors: dict[str, Any] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return digest(tensors)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class ServerProc:
    def __init__(
        self, model_dir: Path, sock: Path, device: str = "cpu", *extra: str, log: Path | None = None
    ):
        self.sock = sock
        self.log = log or sock.with_suffix(".log")
        self._logf = open(self.log, "wb")  # noqa: SIM115 - open for the process lifetime
        cmd = [
            sys.executable,
            "-m",
            "lorafn.backbone_server.cli",
            "serve",
            "--model",
            str(model_dir),
            "--socket",
            str(sock),
            "--device",
            device,
            *extra,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=_env(), start_new_session=True
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            if self.sock.exists():
                with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(self.sock))
                    return
            time.sleep(0.05)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        if not self._logf.closed:
            self._logf.flush()
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._logf.close()
        return self.proc.returncode


class Probe:
    """A worker process attached to the server; `ask` sends a command and reads one JSON reply."""

    def __init__(self, sock: Path, device: str = "cpu", name: str = "probe", *extra: str):
        cmd = [
            sys.executable,
            str(Path(__file__).resolve().parents[3] / "bench" / "_probe.py"),
            "--socket",
            str(sock),
            "--device",
            device,
            "--name",
            name,
            *extra,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(),
            text=True,
            bufsize=1,
        )
        self.attached: dict[str, Any] | None = None
        self._stderr: str | None = None

    def read(self, timeout: float = 120.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            raise TimeoutError(f"probe {self.proc.pid}: no reply in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError(f"probe {self.proc.pid} exited ({self.proc.wait()}): {self.stderr()}")
        return json.loads(line)

    def wait_attached(self, timeout: float = 120.0) -> dict[str, Any]:
        msg = self.read(timeout)
        if msg.get("event") != "attached":
            raise RuntimeError(f"probe did not attach: {msg}; stderr: {self.stderr()}")
        self.attached = msg
        return msg

    def ask(self, cmd: str, timeout: float = 120.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def stderr(self) -> str:
        """Everything the probe wrote to stderr, once it has exited (read once, then cached)."""
        if self._stderr is None:
            if self.proc.poll() is None or self.proc.stderr is None:
                return ""
            self._stderr = self.proc.stderr.read()
        return self._stderr

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write("exit\n")  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(Exception):
                f.close()  # type: ignore[union-attr]
