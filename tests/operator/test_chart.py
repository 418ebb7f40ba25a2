"""The Helm chart, rendered by the real `helm` (v4) binary; every object validated by kubernetes-validate."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "lorafn"
HELM = shutil.which("helm", path=f"{ROOT / '.tools' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")

VARIANTS = {
    "defaults": [],
    "dra-ingress-monitoring": [
        "--set",
        "gpu.sharing=dra",
        "--set",
        "gateway.ingress.enabled=true",
        "--set",
        "gateway.ingress.className=nginx",
        "--set",
        "gateway.ingress.tlsSecretName=lorafn-tls",
        "--set",
        "gateway.externalURL=https://lorafn.example.com",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.serviceMonitor.labels.release=prom",
        "--set",
        "operator.pvcClaims={models,adapters}",
        "--set",
        "gateway.pvcClaims={models}",
        "--set",
        "operator.watchNamespaces={team-a,team-b}",
    ],
    "external-redis": [
        "--set",
        "redis.enabled=false",
        "--set",
        "redis.externalURL=redis://redis.example:6379/0",
        "--set",
        "gpu.runtimeClassName=nvidia",
        "--set",
        "operator.verbose=true",
        "--set",
        "redis.persistence.enabled=false",
    ],
    "graph-archives": [
        "--set",
        "gpu.graphArchives.enabled=true",
        "--set",
        "gpu.graphArchives.hostPath=/srv/lorafn/graphs",
    ],
}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    if HELM is None:
        pytest.fail("helm not found: scripts/install_helm.sh installs it into .tools/bin")
    return subprocess.run([HELM, *args], capture_output=True, text=True, check=check)


def render(extra: list[str]) -> list[dict[str, Any]]:
    out = helm(
        "template", "lorafn", str(CHART), "--namespace", "lorafn-system", "--include-crds", *extra
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def controller_env(extra: list[str]) -> dict[str, str | None]:
    """The controller Deployment's environment as the chart renders it with ``extra`` helm arguments."""
    controller = next(
        o for o in render(extra) if o["kind"] == "Deployment" and o["metadata"]["name"] == "lorafn-controller"
    )
    return {e["name"]: e.get("value") for e in controller["spec"]["template"]["spec"]["containers"][0]["env"]}


def assert_refused(value: str, *bad: list[str]) -> None:
    """Each of the ``bad`` helm arguments is refused by the chart's schema, naming ``value``."""
    for args in bad:
        out = helm("template", "x", str(CHART), *args, check=False)
        assert out.returncode != 0 and value in out.stderr, out.stderr


def test_helm_is_v4() -> None:
    assert helm("version", "--short").stdout.startswith("v4.")


def test_helm_lint_strict() -> None:
    result = helm("lint", "--strict", str(CHART), check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    if obj["kind"] in ("Deployment", "StatefulSet"):
        return [obj["spec"]["template"]["spec"]]
    return []


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_rendered_object_is_valid(variant: str) -> None:
    objs = render(VARIANTS[variant])
    kinds = {o["kind"] for o in objs}
    assert {"CustomResourceDefinition", "Deployment", "Service", "ClusterRole", "Role"} <= kinds
    for obj in objs:
        if obj["kind"] == "ServiceMonitor":  # a Prometheus Operator CRD: no schema in kubernetes-validate
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            assert obj["spec"]["endpoints"][0]["path"] == "/metrics"
            continue
        for version in ("1.30.0", "1.37.0"):
            kubernetes_validate.validate(obj, version, strict=True)
        for pod in _pod_specs(obj):
            assert pod["securityContext"]["runAsNonRoot"] is True
            for container in pod["containers"]:
                sc = container["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
                assert container["resources"]["requests"] and container["resources"]["limits"]
            assert not pod.get("hostIPC") and not pod.get("hostPID") and not pod.get("hostNetwork")


def test_variants_switch_what_they_should() -> None:
    default = {(o["kind"], o["metadata"]["name"]) for o in render([])}
    assert ("StatefulSet", "lorafn-redis") in default and ("Ingress", "lorafn-gateway") not in default
    dra = render(VARIANTS["dra-ingress-monitoring"])
    role = next(o for o in dra if o["kind"] == "Role")
    assert any("resourceclaims" in r["resources"] for r in role["rules"])
    operator = next(
        o for o in dra if o["kind"] == "Deployment" and o["metadata"]["name"] == "lorafn-operator"
    )
    container = operator["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LORAFN_OPERATOR_GPU_SHARING"] == "dra"
    assert env["LORAFN_OPERATOR_GATEWAY_URL"] == "https://lorafn.example.com"
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/mnt/pvc/models", "/mnt/pvc/adapters"}
    assert container["args"].count("--namespace") == 2
    ext = render(VARIANTS["external-redis"])
    assert not any(o["kind"] == "StatefulSet" for o in ext)
    op = next(o for o in ext if o["kind"] == "Deployment" and o["metadata"]["name"] == "lorafn-operator")
    env = {e["name"]: e.get("value") for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LORAFN_OPERATOR_REDIS_URL"] == "redis://redis.example:6379/0"
    assert env["LORAFN_OPERATOR_RUNTIME_CLASS_NAME"] == "nvidia"


def test_operator_config_reads_the_chart_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The env the chart sets is exactly what OperatorConfig parses (no silently ignored names)."""
    from lorafn.operator.config import OperatorConfig

    op = next(
        o
        for o in render(VARIANTS["dra-ingress-monitoring"])
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "lorafn-operator"
    )
    env = {
        e["name"]: e["value"]
        for e in op["spec"]["template"]["spec"]["containers"][0]["env"]
        if e["name"].startswith("LORAFN_")
    }
    fields = {f"LORAFN_OPERATOR_{name.upper()}" for name in OperatorConfig.model_fields}
    assert set(env) <= fields, set(env) - fields
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = OperatorConfig()
    assert config.namespace == "lorafn-system" and config.gpu_sharing == "dra"
    assert config.server_resources["limits"]["memory"] == "64Gi"
    assert config.workload_service_account == "lorafn-workload"


def test_rbac_is_least_privilege() -> None:
    objs = render([])
    cluster_role = next(o for o in objs if o["kind"] == "ClusterRole")
    for rule in cluster_role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        assert "pods" not in rule["resources"]  # pods only in the release namespace (Role)
        if "secrets" in rule["resources"]:
            assert rule["verbs"] == ["get"]
    role = next(o for o in objs if o["kind"] == "Role")
    assert role["metadata"]["namespace"] == "lorafn-system"
    workload = next(
        o for o in objs if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == "lorafn-workload"
    )
    assert workload["automountServiceAccountToken"] is False


def test_values_schema_rejects_bad_values() -> None:
    bad = helm("template", "x", str(CHART), "--set", "gpu.sharing=mps", check=False)
    assert bad.returncode != 0 and "sharing" in bad.stderr
    bad = helm("template", "x", str(CHART), "--set", "redis.enabled=false", check=False)
    assert bad.returncode != 0 and "redis.externalURL is required" in bad.stderr
    bad = helm("template", "x", str(CHART), "--set", "gpu.graphArchives.hostPath=rel", check=False)
    assert bad.returncode != 0 and "hostPath" in bad.stderr, bad.stderr


def test_every_value_is_documented() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "render_manifests", ROOT / "scripts" / "render_manifests.py"
    )
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    documented = {key for key, _, _ in module.documented_values((CHART / "values.yaml").read_text())}

    def leaves(node: Any, prefix: str = "") -> list[str]:
        if prefix and prefix in documented:
            return []
        if isinstance(node, dict) and node:
            return [leaf for k, v in node.items() for leaf in leaves(v, f"{prefix}.{k}" if prefix else k)]
        return [prefix]

    undocumented = [leaf for leaf in leaves(values) if leaf not in documented]
    assert undocumented == []
    readme = (CHART / "README.md").read_text()
    assert all(f"`{key}`" in readme for key in documented)


def test_uri_allow_lists_reach_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    """operator.fileRoot / operator.pvcAccess (issue 15): off by default, and what is set is what the
    operator's ClusterURIPolicy enforces; a bad value is refused by the schema."""
    from lorafn.operator.config import OperatorConfig

    def operator_config(extra: list[str]) -> OperatorConfig:
        op = next(
            o
            for o in render(extra)
            if o["kind"] == "Deployment" and o["metadata"]["name"] == "lorafn-operator"
        )
        for e in op["spec"]["template"]["spec"]["containers"][0]["env"]:
            if e["name"].startswith("LORAFN_OPERATOR_"):
                monkeypatch.setenv(e["name"], e["value"])
        return OperatorConfig()

    default = operator_config([]).uri_policy()
    assert default.refusal("file:///srv/lorafn/fr", "team-a") is not None
    assert default.refusal("pvc://models/x", "team-a") is not None
    policy = operator_config(
        ["--set", "operator.fileRoot=/srv/lorafn", "--set-json", 'operator.pvcAccess={"models":["*"]}']
    ).uri_policy()
    assert policy.refusal("file:///srv/lorafn/fr", "team-a") is None
    assert policy.refusal("file:///etc/fr", "team-a") is not None
    assert policy.refusal("pvc://models/x", "team-a") is None
    bad = helm("template", "lorafn", str(CHART), "--set", "operator.fileRoot=relative", check=False)
    assert bad.returncode != 0 and "fileRoot" in bad.stderr, bad.stderr


def _gpu_pods(config: Any) -> list[dict[str, Any]]:
    """The pods the operator builds for one GPU under `config` (an OperatorConfig): a standby worker, a worker
    bound to a function, the backbone server."""
    from lorafn.api.specs import BackboneSpec, FunctionRef, LoRAFunctionSpec
    from lorafn.operator import builders

    body = {"metadata": {"name": "bb", "uid": "u"}, "spec": {"model": {"uri": "pvc://models/bb"}}}
    spec = BackboneSpec.model_validate(body["spec"])
    slot = builders.GPUSlot("node-1", 0, uuid="GPU-1")
    fn_spec = LoRAFunctionSpec.model_validate({"backbone": "bb", "adapter": {"uri": "pvc://adapters/fr"}})
    return [
        builders.build_standby_pod(body, spec, slot, 0, config),
        builders.build_worker_pod(
            FunctionRef(namespace="a", name="fr"), 0, fn_spec, body, spec, slot, config
        ),
        builders.build_server_pod(body, spec, slot, config),
    ]


def _operator_env(extra: list[str]) -> dict[str, str]:
    op = next(
        o for o in render(extra) if o["kind"] == "Deployment" and o["metadata"]["name"] == "lorafn-operator"
    )
    return {
        e["name"]: e["value"]
        for e in op["spec"]["template"]["spec"]["containers"][0]["env"]
        if e["name"].startswith("LORAFN_OPERATOR_")
    }


@pytest.mark.parametrize(
    ("extra", "volume"),
    [
        ([], None),
        (
            VARIANTS["graph-archives"],
            {"hostPath": {"path": "/srv/lorafn/graphs", "type": "DirectoryOrCreate"}},
        ),
        (
            ["--set", "gpu.graphArchives.enabled=true", "--set", "gpu.graphArchives.claim=graphs"],
            {"persistentVolumeClaim": {"claimName": "graphs"}},
        ),
    ],
    ids=["off", "hostPath", "claim"],
)
def test_graph_archive_values_reach_the_worker_settings(
    extra: list[str], volume: dict[str, Any] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpu.graphArchives.* -> the operator Deployment's env -> OperatorConfig -> the worker pods the
    operator builds (validated) -> the real WorkerSettings of the worker process in them."""
    from lorafn.operator import builders
    from lorafn.operator.config import OperatorConfig
    from lorafn.runtime.worker import WorkerSettings

    for name, value in _operator_env(extra).items():
        monkeypatch.setenv(name, value)
    config = OperatorConfig()
    assert config.graph_archives is (volume is not None)
    pods = _gpu_pods(config)
    for pod in pods:
        for version in ("1.30.0", "1.37.0"):
            kubernetes_validate.validate(pod, version, strict=True)
    for pod in pods[:2]:
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        if volume is None:
            assert builders.GRAPH_ARCHIVE_VOLUME not in volumes
        else:
            assert volumes[builders.GRAPH_ARCHIVE_VOLUME] == {"name": builders.GRAPH_ARCHIVE_VOLUME, **volume}
        for name in ("LORAFN_GRAPH_ARCHIVES", "LORAFN_GRAPH_ARCHIVE_DIR"):
            monkeypatch.delenv(name, raising=False)
        for e in pod["spec"]["containers"][0]["env"]:
            if e["name"].startswith("LORAFN_") and "value" in e:
                monkeypatch.setenv(e["name"], e["value"])
        settings = WorkerSettings()
        assert settings.graph_archives is (volume is not None)
        assert settings.graph_archive_dir == (builders.GRAPH_ARCHIVE_MOUNT if volume else None)


@pytest.mark.parametrize(
    ("extra", "expected", "seconds"),
    [
        ([], "300", 300.0),  # the chart's default
        (["--set", "x=null"], None, 300.0),  # absent: the controller's default
        (["--set-string", "x=inf"], "inf", math.inf),
        (["--set", "x=120"], "120", 120.0),
        (["--set-string", "x=function"], "function", None),  # the function's keep-alive
    ],
)
def test_the_parked_keep_alive_reaches_the_controller_settings(
    monkeypatch: pytest.MonkeyPatch, extra: list[str], expected: str | None, seconds: float | None
) -> None:
    """controller.parkedKeepAliveSeconds -> LORAFN_PARKED_KEEP_ALIVE_S (absent when null) -> the controller's
    parked_keep_alive_s; a negative number or another string is refused by the schema."""
    from lorafn.controller.cli import ControllerSettings

    extra = [a.replace("x=", "controller.parkedKeepAliveSeconds=") for a in extra]
    env = controller_env(extra)
    assert env.get("LORAFN_PARKED_KEEP_ALIVE_S") == expected
    monkeypatch.delenv("LORAFN_PARKED_KEEP_ALIVE_S", raising=False)
    if expected is not None:
        monkeypatch.setenv("LORAFN_PARKED_KEEP_ALIVE_S", expected)
    assert ControllerSettings().parked_keep_alive_s == seconds
    assert_refused(
        "parkedKeepAliveSeconds",
        ["--set", "controller.parkedKeepAliveSeconds=-3"],
        ["--set-string", "controller.parkedKeepAliveSeconds=soon"],
    )


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ([], "50"),
        (["--set", "x=null"], None),
        (["--set", "x=never"], "never"),
        (["--set-json", "x=2.5"], "2.5"),
    ],
)
def test_park_after_reaches_the_controller_settings(
    monkeypatch: pytest.MonkeyPatch, extra: list[str], expected: str | None
) -> None:
    """controller.parkAfterSeconds (50 by default) -> LORAFN_PARK_AFTER_S (absent when null: the controller's
    default, the same 50) -> the controller's park_after_s ("never": inf, only under memory pressure); zero, a
    negative number or another string is refused by the schema."""
    from lorafn.controller.cli import ControllerSettings

    extra = [a.replace("x=", "controller.parkAfterSeconds=") for a in extra]
    env = controller_env(extra)
    assert env.get("LORAFN_PARK_AFTER_S") == expected
    monkeypatch.delenv("LORAFN_PARK_AFTER_S", raising=False)
    if expected is not None:
        monkeypatch.setenv("LORAFN_PARK_AFTER_S", expected)
    seconds = {None: 50.0, "never": float("inf")}.get(expected) or float(expected or 0)
    assert ControllerSettings().park_after_s == seconds
    assert_refused(
        "parkAfterSeconds",
        ["--set", "controller.parkAfterSeconds=0"],
        ["--set", "controller.parkAfterSeconds=-3"],
        ["--set-string", "controller.parkAfterSeconds=soon"],
    )


@pytest.mark.parametrize(
    ("extra", "expected"), [([], None), (["--set-json", "controller.scaleUpWaitFraction=0.2"], "0.2")]
)
def test_scale_up_on_wait_reaches_the_controllers_policy(
    monkeypatch: pytest.MonkeyPatch, extra: list[str], expected: str | None
) -> None:
    """controller.scaleUpWaitFraction -> LORAFN_SCALE_UP_WAIT_FRACTION (absent when null) -> the controller's
    settings -> its policy's scale_up_wait_fraction; 0, above 1 or a string is refused by the schema."""
    from lorafn.controller.cli import ControllerSettings, build_controller

    env = controller_env(extra)
    assert env.get("LORAFN_SCALE_UP_WAIT_FRACTION") == expected
    monkeypatch.delenv("LORAFN_SCALE_UP_WAIT_FRACTION", raising=False)
    if expected is not None:
        monkeypatch.setenv("LORAFN_SCALE_UP_WAIT_FRACTION", expected)
    policy = build_controller(ControllerSettings(redis_url="redis://127.0.0.1:1")).config.policy
    assert policy.scale_up_wait_fraction == (None if expected is None else float(expected))
    assert_refused(
        "scaleUpWaitFraction",
        ["--set", "controller.scaleUpWaitFraction=0"],
        ["--set", "controller.scaleUpWaitFraction=1.5"],
        ["--set-string", "controller.scaleUpWaitFraction=soon"],
    )


@pytest.mark.parametrize(("extra", "mib"), [([], 0), (["--set", "controller.burstKvMiB=1024"], 1024)])
def test_burst_kv_reaches_the_controllers_policy(
    monkeypatch: pytest.MonkeyPatch, extra: list[str], mib: int
) -> None:
    """controller.burstKvMiB -> LORAFN_BURST_KV_MIB -> the controller's settings -> the policy the built
    controller decides with (PolicyConfig.burst_kv_bytes; 0 = off, the default); a negative number or a
    string is refused by the schema."""
    from lorafn.controller.cli import ControllerSettings, build_controller

    env = controller_env(extra)
    assert env["LORAFN_BURST_KV_MIB"] == str(mib)
    monkeypatch.setenv("LORAFN_BURST_KV_MIB", env["LORAFN_BURST_KV_MIB"])
    settings = ControllerSettings(redis_url="redis://127.0.0.1:1")
    assert build_controller(settings).config.policy.burst_kv_bytes == mib << 20
    assert_refused(
        "burstKvMiB", ["--set", "controller.burstKvMiB=-1"], ["--set-string", "controller.burstKvMiB=lots"]
    )


@pytest.mark.parametrize(
    ("extra", "expected"), [([], ""), (["--set-string", "gpu.prefillGraphTokens=512\\, 128"], "128,512")]
)
def test_prefill_graph_tokens_reach_the_worker_settings(
    extra: list[str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpu.prefillGraphTokens -> the operator's env -> OperatorConfig -> the worker pods' env (only when set)
    -> the real WorkerSettings, whose buckets the engine takes; a value that is no list of numbers is refused
    by the schema."""
    from lorafn.operator.config import OperatorConfig
    from lorafn.runtime.worker import WorkerSettings

    for name, value in _operator_env(extra).items():
        monkeypatch.setenv(name, value)
    config = OperatorConfig()
    pods = _gpu_pods(config)[:2]  # the standby's and the bound worker's
    for pod in pods:
        kubernetes_validate.validate(pod, "1.37.0", strict=True)
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert ("LORAFN_PREFILL_GRAPH_TOKENS" in env) is bool(expected)
        monkeypatch.delenv("LORAFN_PREFILL_GRAPH_TOKENS", raising=False)
        for name, value in env.items():
            if name.startswith("LORAFN_") and value is not None:
                monkeypatch.setenv(name, value)
        assert WorkerSettings().prefill_graph_tokens == expected
    out = helm("template", "x", str(CHART), "--set-string", "gpu.prefillGraphTokens=lots", check=False)
    assert out.returncode != 0 and "prefillGraphTokens" in out.stderr, out.stderr
    # numbers the schema lets through but no engine takes: refused when the operator starts, not by every
    # worker pod at its start
    with pytest.raises(ValueError, match="prefill_graph_tokens: buckets of at least 2 tokens"):
        OperatorConfig(prefill_graph_tokens="1,64")
