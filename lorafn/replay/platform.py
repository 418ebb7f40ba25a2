"""A platform of one configuration for a replay: `lorafn up` as a child process (its own state directory,
any free ports), the backbone and N functions registered the way `lorafn apply -f` registers them, and
a wait until it is settled (backbone loaded, warm pool or always-on workers up) before arrivals start.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lorafn.local.apply import apply_manifest
from lorafn.local.config import LocalConfig, PlatformState
from lorafn.local.manifests import parse_manifest
from lorafn.local.procs import child_env, lorafn_argv
from lorafn.replay.configs import ReplayConfig
from lorafn.store import UNAVAILABLE_ERRORS, Keys, Store
from lorafn.store import workers as wk

BACKBONE = "replay-backbone"
NAMESPACE = "replay"


def local_config_fields() -> set[str]:
    """The settings this build's `lorafn up` accepts (an ablation whose switch is missing cannot run)."""
    return set(LocalConfig.model_fields)


def prepare_model(preset: str, out: Path, dtype: str) -> Path:
    """A random model of `preset`'s real shape under `out` (written once, reused by later runs)."""
    from lorafn.models.random_model import write_random_model

    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    return write_random_model(preset, out, seed=0, dtype=dtype, progress=True)


def prepare_adapters(
    model_dir: Path, out: Path, count: int, rank: int, targets: list[str] | str
) -> list[Path]:
    """`count` random PEFT adapters (seeds 0..count-1) for the model (written once, reused)."""
    from lorafn.runtime.config import ModelConfig
    from lorafn.runtime.lora import write_random_adapter

    mc = ModelConfig.from_dir(model_dir)
    paths = []
    for i in range(count):
        path = out / f"adapter-r{rank}-{i}"
        if not (path / "adapter_model.safetensors").exists():
            write_random_adapter(mc, path, rank=rank, lora_alpha=2.0 * rank, seed=i, target_modules=targets)
        paths.append(path)
    return paths


def own_adapter_dirs(adapters: list[Path], functions: list[str], out: Path) -> list[Path]:
    """One adapter directory per function, as tenants have, in the order of ``functions``: function i gets
    the files of ``adapters[i % len(adapters)]`` as hard links (no extra disk; copies where links cannot be
    made). With shared directories `lorafn apply` warned for every second function that it could read the
    other's adapter (32 functions over 8 adapters: 24 warnings at the head of each replay)."""
    if not adapters:
        raise ValueError("adapters: at least one adapter directory is needed")
    paths = []
    for i, fn in enumerate(functions):
        src = adapters[i % len(adapters)]
        dst = out / fn.replace("/", "-")
        dst.mkdir(parents=True, exist_ok=True)
        for f in sorted(src.iterdir()):
            if not f.is_file():
                continue
            target = dst / f.name
            if target.exists():
                if os.path.samefile(f, target):
                    continue
                target.unlink()  # an earlier run mapped this function to another adapter
            try:
                os.link(f, target)
            except OSError:
                shutil.copy2(f, target)
        paths.append(dst)
    return paths


@dataclass(frozen=True)
class FunctionSetup:
    """What every function of a replay is registered with."""

    slo_ttft_ms: int
    keep_alive_s: int
    max_replicas: int
    kv_cache_mib: int | None = None


def manifest(
    model_dir: Path,
    dtype: str,
    functions: list[str],
    adapters: list[Path],
    keys: dict[str, str],
    setup: FunctionSetup,
    config: ReplayConfig,
    warm_pool_off_by_spec: bool,
    *,
    namespace: str = NAMESPACE,
    secret: str = "replay-keys",
    slos: Mapping[str, int] | None = None,
    adapter_slots: int = 1,
) -> str:
    """The YAML `lorafn apply -f` would take: a Backbone, a Secret of keys and the LoRAFunctions (in
    `namespace`, the keys in the Secret `secret`; other benchmarks, e.g. bench/batch.py, use their own).
    `slos`: a TTFT SLO (ms) per function, for those it names (bench/admission.py); the others get
    `setup.slo_ttft_ms`. `adapter_slots`: the Backbone's (docs/runtime.md#adapter-slots; 1: one function
    per worker)."""
    # file:// URIs must hold absolute paths (the spec refuses others): a bench's relative --workdir too
    backbone_spec: dict[str, Any] = {"model": {"uri": f"file://{model_dir.resolve()}"}, "dtype": dtype}
    if warm_pool_off_by_spec and config.warm_pool_fallback is not None:
        low, high = config.warm_pool_fallback
        backbone_spec["warmPool"] = {"minStandby": low, "maxStandby": high}
    if adapter_slots > 1:
        backbone_spec["adapterSlots"] = adapter_slots
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "lorafn.io/v1alpha1",
            "kind": "Backbone",
            "metadata": {"name": BACKBONE},
            "spec": backbone_spec,
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": secret, "namespace": namespace},
            "stringData": {fn.split("/", 1)[1]: keys[fn] for fn in functions},
        },
    ]
    for i, fn in enumerate(functions):
        name = fn.split("/", 1)[1]
        spec: dict[str, Any] = {
            "backbone": BACKBONE,
            "adapter": {"uri": f"file://{adapters[i % len(adapters)].resolve()}"},
            "slo": {"ttftMs": (slos or {}).get(fn, setup.slo_ttft_ms)},
            "scaling": {
                "minReplicas": config.min_replicas,
                "maxReplicas": max(setup.max_replicas, config.min_replicas, 1),
                "keepAliveSeconds": config.keep_alive_s or setup.keep_alive_s,
            },
            "auth": {"apiKeySecretRef": {"name": secret, "key": name}},
        }
        if setup.kv_cache_mib:
            spec["resources"] = {"kvCacheMiB": setup.kv_cache_mib}
        docs.append(
            {
                "apiVersion": "lorafn.io/v1alpha1",
                "kind": "LoRAFunction",
                "metadata": {"name": name, "namespace": namespace},
                "spec": spec,
            }
        )
    return yaml.safe_dump_all(docs, sort_keys=False)


class ManagedPlatform:
    """`lorafn up --config <workdir>/up.yaml --state-dir <a short temporary directory>`, a child of the
    replay; its output goes to <workdir>/up.log, its component logs to <workdir>/logs."""

    def __init__(self, workdir: Path, settings: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        # Unix socket paths hold at most 107 bytes, and the backbone server's lies under the state dir:
        # a short directory of its own (logs are copied into the workdir when it stops)
        self.state_dir = Path(tempfile.mkdtemp(prefix="lorafn-replay-"))
        self.settings = {**settings, "gateway_port": 0, "redis_port": 0}
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.state: PlatformState | None = None
        self.store: Store | None = None
        self.log_path = workdir / "up.log"

    @property
    def keys(self) -> Keys:
        assert self.state is not None
        return Keys(self.state.key_prefix)

    def start(self, timeout_s: float = 300.0) -> PlatformState:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "up.yaml"
        config.write_text(
            yaml.safe_dump({k: (str(v) if isinstance(v, Path) else v) for k, v in self.settings.items()})
        )
        argv = lorafn_argv("up", "--config", str(config), "--state-dir", str(self.state_dir))
        env = child_env({"PYTHONUNBUFFERED": "1", **self.env})
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        path = PlatformState.path(self.state_dir)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lorafn up exited with {self.proc.returncode}:\n{self.log_tail()}")
            if path.exists():
                try:
                    self.state = PlatformState.read(self.state_dir)
                    break
                except ValueError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"lorafn up did not come up in {timeout_s:g} s:\n{self.log_tail()}")
            time.sleep(0.2)
        self.store = Store(self.state.redis_url)
        return self.state

    def check_alive(self, wait_s: float = 0.0) -> None:
        """RuntimeError with the log's tail when `lorafn up` has exited (waiting up to `wait_s` for it)."""
        if self.proc is None:
            return
        try:
            code = self.proc.wait(timeout=wait_s) if wait_s else self.proc.poll()
        except subprocess.TimeoutExpired:
            return
        if code is not None:
            raise RuntimeError(f"lorafn up exited with {code}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def apply(self, text: str) -> None:
        assert self.store is not None
        (self.workdir / "functions.yaml").write_text(text)
        apply_manifest(self.store, self.keys, parse_manifest(text))

    def workers(self) -> dict[str, dict[str, str]]:
        assert self.store is not None
        ids = self.store.run(wk.worker_ids(self.keys))
        return self.store.run(wk.worker_info(self.keys, ids)) if ids else {}

    def settle(
        self, functions: list[str], min_replicas: int, want_standby: bool, shared: bool, timeout_s: float
    ) -> dict[str, Any]:
        """Wait until the platform is what a user would find before traffic: the backbone server up (when
        shared), a standby worker (when the warm pool is on), `min_replicas` bound workers per function.
        Returns what was found; a timeout is reported, not raised (the run then shows the cost)."""
        deadline = time.monotonic() + timeout_s
        found: dict[str, Any] = {}
        while True:
            self.check_alive()
            try:
                ws = self.workers()
            except UNAVAILABLE_ERRORS:
                self.check_alive(wait_s=5.0)  # Redis gone: `lorafn up` is ending; say why
                raise
            # a backbone server's socket (`<backbone>.<device>.sock`, whatever the backbone's name), not the
            # zygote's
            sockets = [p for p in (self.state_dir / "sockets").glob("*.sock") if p.name != "zygote.sock"]
            standby = sum(h.get("state") == "standby" for h in ws.values())
            # a worker with adapter slots counts for every function it serves (`functions`, first one first)
            bound = {
                fn: sum(
                    fn in (h.get("functions") or h.get("function") or "").split(",")
                    and h.get("state") != "standby"
                    for h in ws.values()
                )
                for fn in functions
            }
            found = {
                "backbone_server": bool(sockets),
                "standby": standby,
                "bound_min": min(bound.values()) if bound else 0,
            }
            ready = (
                (not shared or found["backbone_server"])
                and (not want_standby or standby >= 1)
                and found["bound_min"] >= min_replicas
            )
            if ready:
                found["settled"] = True
                return found
            if time.monotonic() > deadline:
                found["settled"] = False
                return found
            time.sleep(0.5)

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop `lorafn up` (SIGTERM, as `lorafn down` does: workers drain first), keep its logs under the
        workdir, drop its state. Not SIGINT: a process started from a background job of a shell without job
        control inherits SIGINT ignored, and `up` then never heard it (each stop waited `timeout_s`, then
        killed `up` and left its children running: seen as a CI run launched that way)."""
        if self.store is not None:
            self.store.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        logs = self.state_dir / "logs"
        if logs.is_dir():
            shutil.copytree(logs, self.workdir / "logs", dirs_exist_ok=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)


def registry_facts(
    redis_url: str, key_prefix: str, functions: list[str]
) -> tuple[dict[str, float], dict[str, int]]:
    """From a running platform's registry: each function's spec.slo.ttftMs (functions not registered are
    left out) and the weight bytes of their backbones (by name)."""
    from lorafn.api import LoRAFunctionSpec
    from lorafn.store.backbones import get_backbone
    from lorafn.store.registry import get_function

    store = Store(redis_url)
    keys = Keys(key_prefix)
    slo: dict[str, float] = {}
    weights: dict[str, int] = {}
    try:
        for fn in functions:
            record = store.run(get_function(keys, fn))
            if record is None:
                continue
            spec = LoRAFunctionSpec.model_validate(record.spec)
            slo[fn] = float(spec.slo.ttft_ms)
            if spec.backbone not in weights:
                bb = store.run(get_backbone(keys, spec.backbone))
                weights[spec.backbone] = backbone_bytes(Path(bb.model_dir)) if bb is not None else 0
    finally:
        store.close()
    return slo, weights


def new_keys(functions: list[str]) -> dict[str, str]:
    return {fn: f"lfn-replay-{secrets.token_urlsafe(18)}" for fn in functions}


def backbone_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def read_keys_file(path: Path) -> dict[str, str]:
    """`{"namespace/name": "key", ...}` (JSON or YAML) for a replay against a platform it did not start."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--keys {path}: {exc}") from None
    if not isinstance(data, dict) or not data or not all(isinstance(k, str) for k in data):
        raise ValueError(f"--keys {path}: expected a mapping of namespace/name -> API key")
    return {str(k): "" if v is None else str(v) for k, v in data.items()}


def _json_default(value: object) -> str:
    return str(value)


def dump_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=_json_default))
    os.replace(tmp, path)
