"""Every command line the operator and the chart give a pod parses with the real `lorafn` CLI, and every
environment variable they set names a field of the settings class that command reads.

This is how a pod once got `lorafn worker serve --standby`, an option that did not exist, and was
recreated every ~10 s: the builders and the CLI drifted apart and nothing parsed one with the other.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import pytest
import typer.main
from typer import Context
from typer._click.exceptions import UsageError  # typer vendors its own click: its parse errors
from typer.core import TyperGroup

import lorafn.cli
from lorafn.api.specs import BackboneSpec, FunctionRef, LoRAFunctionSpec
from lorafn.operator import builders
from lorafn.operator.builders import GPUSlot
from lorafn.operator.config import OperatorConfig
from tests.operator.test_chart import VARIANTS, render

# The settings class each pod command reads its environment through; None: configured by options only.
SETTINGS_OF: dict[tuple[str, ...], str | None] = {
    ("backbone-server", "serve"): None,
    ("worker", "serve"): "lorafn.runtime.worker:WorkerSettings",
    ("gateway", "serve"): "lorafn.gateway.settings:GatewaySettings",
    ("operator", "run"): "lorafn.operator.config:OperatorConfig",
    ("controller", "run"): "lorafn.controller.cli:ControllerSettings",
}

BACKBONE = {
    "metadata": {"name": "llama-2-7b", "uid": "bb-uid"},
    "spec": {"model": {"uri": "pvc://models/llama-2-7b"}, "dtype": "bfloat16"},
}
FUNCTION_SPEC = {"backbone": "llama-2-7b", "adapter": {"uri": "file:///adapters/french"}}


@dataclass(frozen=True)
class Parsed:
    path: tuple[str, ...]  # sub-command names after `lorafn`
    params: dict[str, Any]


def parse(argv: list[str]) -> Parsed:
    """Resolve `argv` through the `lorafn` click tree and parse the leaf's options, without running it.

    An unknown option, a missing value or an unknown sub-command raises UsageError.
    """
    assert argv[0] == "lorafn", argv
    command = typer.main.get_command(lorafn.cli.app)
    ctx = Context(command, info_name="lorafn")
    args = argv[1:]
    path: list[str] = []
    while isinstance(command, TyperGroup):
        if not args:
            raise UsageError(f"{' '.join(argv)}: no sub-command", ctx)
        sub = command.get_command(ctx, args[0])
        if sub is None:
            raise UsageError(f"no such command {args[0]!r} in {' '.join(['lorafn', *path])}", ctx)
        path.append(args[0])
        command, args = sub, args[1:]
        ctx = Context(command, info_name=path[-1], parent=ctx)
    leaf = command.make_context(path[-1], list(args), parent=ctx.parent)
    return Parsed(tuple(path), dict(leaf.params))


def settings_env_names(path: tuple[str, ...]) -> set[str]:
    """`LORAFN_*` names the command's settings class reads (its env prefix + each field name)."""
    target = SETTINGS_OF[path]
    if target is None:
        return set()
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    prefix = cls.model_config.get("env_prefix", "")
    return {f"{prefix}{field}".upper() for field in cls.model_fields}


def check_pod(container: dict[str, Any]) -> Parsed:
    parsed = parse(container["args"])
    assert parsed.path in SETTINGS_OF, f"no settings entry for `lorafn {' '.join(parsed.path)}`"
    allowed = settings_env_names(parsed.path)
    for env in container.get("env") or []:
        name = env["name"]
        if name in builders.EXTERNAL_ENV:
            continue
        assert name in allowed, f"`lorafn {' '.join(parsed.path)}` reads no setting {name}"
    return parsed


def operator_pods(mode: str) -> dict[str, dict[str, Any]]:
    config = OperatorConfig(gpu_sharing=mode)
    spec = BackboneSpec.model_validate(BACKBONE["spec"])
    slot = GPUSlot("node-1", 0, uuid="GPU-1234")
    ref = FunctionRef(namespace="team-a", name="french")
    fn_spec = LoRAFunctionSpec.model_validate(FUNCTION_SPEC)
    return {
        "server": builders.build_server_pod(BACKBONE, spec, slot, config),
        "standby": builders.build_standby_pod(BACKBONE, spec, slot, 0, config),
        "worker": builders.build_worker_pod(ref, 1, fn_spec, BACKBONE, spec, slot, config),
    }


def _worker_has_standby() -> bool:
    """Whether `lorafn worker serve` has --standby yet (it lands with issue 10, the serverless core)."""
    root = typer.main.get_command(lorafn.cli.app)
    ctx = Context(root)
    worker = root.get_command(ctx, "worker")  # type: ignore[attr-defined]
    serve = worker.get_command(Context(worker, parent=ctx), "serve")
    return any(p.name == "standby" for p in serve.params)


POD_CASES = [
    pytest.param(
        kind,
        mode,
        id=f"{kind}-{mode}",
        marks=[
            pytest.mark.xfail(
                not _worker_has_standby(),
                strict=True,
                raises=UsageError,
                reason="worker --standby lands with issue 10",
            )
        ]
        if kind == "standby"
        else [],
    )
    for kind in ("server", "standby", "worker")
    for mode in ("visibleDevices", "dra")
]


@pytest.mark.parametrize(("kind", "mode"), POD_CASES)
def test_operator_pod_command_parses_and_env_names_settings(kind: str, mode: str) -> None:
    pod = operator_pods(mode)[kind]
    container = pod["spec"]["containers"][0]
    parsed = check_pod(container)
    env = {e["name"]: e for e in container["env"]}
    if kind == "server":
        assert parsed.path == ("backbone-server", "serve")
        assert parsed.params["model"].as_posix() == "/mnt/pvc/models/llama-2-7b"
        assert parsed.params["socket_path"].as_posix() == builders.SOCKET_PATH
        assert parsed.params["http_port"] == builders.SERVER_HTTP_PORT
        return
    assert parsed.path == ("worker", "serve")
    assert parsed.params["device"] == "cuda"
    # The GPU id the controller's inventory uses (the operator writes it: `<node>/<uuid>`), and a KV
    # budget: a worker never sizes its KV cache from the GPU's free memory.
    assert parsed.params["gpu"] == "node-1/GPU-1234"
    assert parsed.params["kv_budget_mib"] == OperatorConfig().default_kv_mib
    # What the workers and the gateway must agree on comes from the operator's config, under shared names.
    assert env["LORAFN_REDIS_URL"]["value"] == OperatorConfig().redis_url
    assert env["LORAFN_KEY_PREFIX"]["value"] == OperatorConfig().key_prefix
    assert float(env["LORAFN_HEARTBEAT_TTL_S"]["value"]) == OperatorConfig().heartbeat_ttl_s
    assert env["LORAFN_BACKBONE_SOCKET"]["value"] == builders.SOCKET_PATH
    assert env["LORAFN_WORKER_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    if kind == "standby":
        assert parsed.params["standby"] is True
        assert parsed.params["backbone"] == "llama-2-7b"
        assert parsed.params["function"] is None  # tenant-neutral until bound
    else:
        assert parsed.params["function"] == "team-a/french"
        assert env["LORAFN_ADAPTER"]["value"] == "/adapters/french"


def test_a_standby_pod_sized_by_the_controller_parses_with_its_budget() -> None:
    """The KV budget the controller granted a standby (`<bb>:standby_kv`) reaches `--kv-budget-mib`."""
    spec = BackboneSpec.model_validate(BACKBONE["spec"])
    slot = GPUSlot("node-1", 0, uuid="GPU-1234")
    pod = builders.build_standby_pod(
        BACKBONE, spec, slot, 1, OperatorConfig(), "q_proj:16", kv_budget_mib=2048
    )
    parsed = check_pod(pod["spec"]["containers"][0])
    assert parsed.path == ("worker", "serve")
    assert parsed.params["kv_budget_mib"] == 2048 and parsed.params["standby"] is True
    assert parsed.params["shape"] == "q_proj:16"


def test_adapter_slots_reach_the_worker_command_line() -> None:
    """A Backbone with `adapterSlots` (docs/runtime.md#adapter-slots): its shaped standby pods and its
    functions' worker pods pass `--adapter-slots`, and the worker settings they parse into build a slot
    engine's config; a shape-agnostic standby gets none (slots are sized by a shape)."""
    from lorafn.runtime.worker import WorkerSettings

    spec = BackboneSpec.model_validate({**BACKBONE["spec"], "adapterSlots": 8})
    slot, config = GPUSlot("node-1", 0, uuid="GPU-1234"), OperatorConfig()
    ref = FunctionRef(namespace="team-a", name="french")
    fn_spec = LoRAFunctionSpec.model_validate(FUNCTION_SPEC)
    shaped = builders.build_standby_pod(BACKBONE, spec, slot, 1, config, "q_proj:16,v_proj:16")
    agnostic = builders.build_standby_pod(BACKBONE, spec, slot, 2, config)
    worker = builders.build_worker_pod(ref, 1, fn_spec, BACKBONE, spec, slot, config)
    for pod, slots in ((shaped, 8), (agnostic, None), (worker, 8)):
        parsed = check_pod(pod["spec"]["containers"][0])
        assert parsed.params["adapter_slots"] == slots
        given = {k: v for k, v in parsed.params.items() if v is not None}
        settings = WorkerSettings(**{k: v for k, v in given.items() if k in WorkerSettings.model_fields})
        assert settings.adapter_slots == (slots or 1)
    # the worker holds the KV of every function that may join it
    assert check_pod(worker["spec"]["containers"][0]).params["kv_budget_mib"] == 8 * config.default_kv_mib


def test_the_contract_refuses_what_the_cli_does_not_know() -> None:
    """The checks above can fail: an unknown option, sub-command or env name is caught."""
    with pytest.raises(UsageError):
        parse(["lorafn", "worker", "serve", "--no-such-option"])
    with pytest.raises(UsageError):
        parse(["lorafn", "worker", "no-such-command"])
    with pytest.raises(AssertionError, match="LORAFN_SLO_TTFT_MS"):
        check_pod(
            {
                "args": ["lorafn", "worker", "serve", "--device", "cuda"],
                "env": [{"name": "LORAFN_SLO_TTFT_MS", "value": "500"}],
            }
        )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chart_pod_commands_parse_and_env_names_settings(variant: str) -> None:
    deployments = [o for o in render(VARIANTS[variant]) if o["kind"] == "Deployment"]
    paths = set()
    for deployment in deployments:
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            paths.add(check_pod(container).path)
    assert paths == {("gateway", "serve"), ("operator", "run"), ("controller", "run")}


def test_chart_controller_and_operator_agree_on_the_default_kv_budget() -> None:
    objs = render(["--set", "controller.defaultKvMiB=384", "--set", "controller.workerOverheadMiB=600"])
    env = {}
    for obj in objs:
        if obj["kind"] == "Deployment":
            for container in obj["spec"]["template"]["spec"]["containers"]:
                env[container["name"]] = {e["name"]: e.get("value") for e in container["env"]}
    assert (
        env["controller"]["LORAFN_DEFAULT_KV_MIB"]
        == env["operator"]["LORAFN_OPERATOR_DEFAULT_KV_MIB"]
        == "384"
    )
    assert env["controller"]["LORAFN_WORKER_OVERHEAD_MIB"] == "600"
    controller = next(
        o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-controller")
    )
    assert controller["spec"]["replicas"] == 1
    assert controller["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
