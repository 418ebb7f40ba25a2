import pytest

from lorafn.api import BackboneSpec, FunctionRef, LoRAFunctionSpec
from lorafn.operator import builders
from lorafn.operator.builders import GPUSlot, select_gpu_slots
from lorafn.operator.config import OperatorConfig
from tests.unit.operator._k8s import validate

BACKBONE = {
    "apiVersion": "lorafn.io/v1alpha1",
    "kind": "Backbone",
    "metadata": {"name": "llama-2-7b", "uid": "bb-uid", "generation": 1},
    "spec": {"model": {"uri": "pvc://models/llama-2-7b"}, "warmPool": {"minStandby": 2}},
}
FUNCTION = {
    "apiVersion": "lorafn.io/v1alpha1",
    "kind": "LoRAFunction",
    "metadata": {"name": "french", "namespace": "team-a", "uid": "fn-uid", "generation": 3},
    "spec": {"backbone": "llama-2-7b", "adapter": {"uri": "file:///adapters/french"}},
}


def node(name: str, count: int | None = 2, uuids: str | None = "GPU-a1,GPU-a2", **labels: str) -> dict:
    meta: dict = {"name": name, "labels": dict(labels), "annotations": {}}
    if count is not None:
        meta["labels"]["nvidia.com/gpu.count"] = str(count)
    meta["labels"]["nvidia.com/gpu.memory"] = "81559"
    if uuids is not None:
        meta["annotations"]["lorafn.io/gpu-uuids"] = uuids
    return {"metadata": meta}


def test_names_are_deterministic_short_and_distinct() -> None:
    slot = GPUSlot("node-1", 0)
    assert builders.server_pod_name("llama", slot) == builders.server_pod_name("llama", GPUSlot("node-1", 0))
    assert builders.server_pod_name("llama", slot) != builders.server_pod_name("llama", GPUSlot("node-1", 1))
    long = "x" * 63
    assert len(builders.standby_pod_name(long, slot, 3)) <= 63
    a = builders.worker_pod_name(FunctionRef(namespace="a-b", name="c"), 0)
    b = builders.worker_pod_name(FunctionRef(namespace="a", name="b-c"), 0)
    assert a != b
    assert len(builders.worker_pod_name(FunctionRef(namespace="n" * 63, name="f" * 63), 999)) <= 63
    assert builders.function_service_name(FunctionRef(namespace="x", name="9lives")).startswith("lfn-")


def test_slots_from_node_annotations_and_selector() -> None:
    spec = BackboneSpec.model_validate(
        {**BACKBONE["spec"], "placement": {"gpus": 2, "nodeSelector": {"pool": "gpu"}}}
    )
    nodes = [node("b", pool="gpu"), node("a", pool="gpu"), node("cpu", count=0, uuids=None, pool="cpu")]
    slots, problems = select_gpu_slots(spec, nodes, OperatorConfig())
    assert problems == []
    assert [(s.node, s.index, s.uuid, s.memory_mib) for s in slots] == [
        ("a", 0, "GPU-a1", 81559),
        ("a", 1, "GPU-a2", 81559),
        ("b", 0, "GPU-a1", 81559),
        ("b", 1, "GPU-a2", 81559),
    ]


def test_slot_problems_have_reasons() -> None:
    spec = BackboneSpec.model_validate({**BACKBONE["spec"], "placement": {"gpus": 2}})
    slots, problems = select_gpu_slots(spec, [node("a", count=1, uuids="")], OperatorConfig())
    assert slots == []
    assert [p.reason for p in problems] == ["InsufficientGPUs", "NoGPUUUID"]
    # DRA mode needs no UUIDs: the scheduler allocates the device.
    slots, problems = select_gpu_slots(
        spec, [node("a", count=1, uuids="")], OperatorConfig(gpu_sharing="dra")
    )
    assert len(slots) == 1 and [p.reason for p in problems] == ["InsufficientGPUs"]
    selective = BackboneSpec.model_validate({**BACKBONE["spec"], "placement": {"nodeSelector": {"x": "y"}}})
    assert select_gpu_slots(selective, [node("a")], OperatorConfig())[1][0].reason == "NoMatchingNodes"


def test_explicit_devices_win() -> None:
    spec = BackboneSpec.model_validate(
        {
            **BACKBONE["spec"],
            "placement": {
                "devices": [
                    {"node": "a", "uuid": "GPU-0000aaaa", "memoryMiB": 40960},
                    {"node": "a", "uuid": "GPU-0000bbbb"},
                ]
            },
        }
    )
    slots, problems = select_gpu_slots(spec, [node("a")], OperatorConfig())
    assert [(s.index, s.uuid, s.memory_mib) for s in slots] == [
        (0, "GPU-0000aaaa", 40960),
        (1, "GPU-0000bbbb", 81559),
    ]
    assert problems == []


@pytest.mark.parametrize("mode", ["visibleDevices", "dra"])
def test_gpu_pods_share_one_gpu_and_are_locked_down(mode: str) -> None:
    config = OperatorConfig(gpu_sharing=mode, runtime_class_name="nvidia")
    spec = BackboneSpec.model_validate(BACKBONE["spec"])
    slot = GPUSlot("node-1", 0, uuid="GPU-1234")
    server = builders.build_server_pod(BACKBONE, spec, slot, config)
    standby = builders.build_standby_pod(BACKBONE, spec, slot, 0, config)
    fn_spec = LoRAFunctionSpec.model_validate(FUNCTION["spec"])
    worker = builders.build_worker_pod(
        FunctionRef(namespace="team-a", name="french"), 0, fn_spec, BACKBONE, spec, slot, config
    )
    for pod in (server, standby, worker):
        validate(pod)
        pod_spec = pod["spec"]
        container = pod_spec["containers"][0]
        assert pod_spec["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["resources"]["requests"] and container["resources"]["limits"]
        assert pod_spec["nodeSelector"] == {"kubernetes.io/hostname": "node-1"}
        sockets = next(v for v in pod_spec["volumes"] if v["name"] == "sockets")
        assert sockets["hostPath"]["path"] == f"/var/run/lorafn/llama-2-7b/{slot.slot_id}"
        assert pod["metadata"]["ownerReferences"][0]["uid"] == "bb-uid"
        assert "hostIPC" not in pod_spec and "hostPID" not in pod_spec
        env = {e["name"]: e.get("value") for e in container["env"]}
        # The server takes the model as an option (it reads no LORAFN_* settings); workers as a setting.
        model = (
            container["args"][container["args"].index("--model") + 1]
            if pod is server
            else env["LORAFN_MODEL"]
        )
        assert model == "/mnt/pvc/models/llama-2-7b"
        if mode == "dra":
            assert pod_spec["resourceClaims"] == [
                {"name": "gpu", "resourceClaimName": f"llama-2-7b-{slot.slot_id}-gpu"}
            ]
            assert "NVIDIA_VISIBLE_DEVICES" not in env
        else:
            assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-1234"
            assert pod_spec["runtimeClassName"] == "nvidia"
    assert server["spec"]["restartPolicy"] == "Always"
    assert worker["spec"]["restartPolicy"] == "Never"
    worker_env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert worker_env["LORAFN_FUNCTION"] == "team-a/french"
    assert worker_env["LORAFN_ADAPTER"] == "/adapters/french"
    assert worker["metadata"]["labels"]["lorafn.io/function-name"] == "french"


def test_a_standby_pod_gets_the_kv_budget_the_controller_granted() -> None:
    """A standby kept for a function whose spec asks for more KV than the default must be started with it:
    a smaller standby can never take that function."""
    config = OperatorConfig()
    spec = BackboneSpec.model_validate(BACKBONE["spec"])
    slot = GPUSlot("node-1", 0, uuid="GPU-1234")

    def kv_arg(pod: dict) -> str:
        args = pod["spec"]["containers"][0]["args"]
        return args[args.index("--kv-budget-mib") + 1]

    sized = builders.build_standby_pod(BACKBONE, spec, slot, 0, config, "q_proj:16", kv_budget_mib=2048)
    validate(sized)
    assert kv_arg(sized) == "2048"
    assert kv_arg(builders.build_standby_pod(BACKBONE, spec, slot, 0, config, "q_proj:16")) == str(
        config.default_kv_mib
    )
    # the budget changes the process, not which pod it is: names stay deterministic per GPU, shape, index
    assert sized["metadata"]["name"] == builders.standby_pod_name("llama-2-7b", slot, 0, "q_proj:16")


def test_resource_claim_pins_the_uuid_when_known() -> None:
    config = OperatorConfig(gpu_sharing="dra")
    claim = builders.build_resource_claim(BACKBONE, GPUSlot("n", 0, uuid="GPU-9"), config)
    validate(claim)
    exactly = claim["spec"]["devices"]["requests"][0]["exactly"]
    assert exactly["deviceClassName"] == "gpu.nvidia.com"
    assert "GPU-9" in exactly["selectors"][0]["cel"]["expression"]
    assert (
        "selectors"
        not in builders.build_resource_claim(BACKBONE, GPUSlot("n", 0), config)["spec"]["devices"][
            "requests"
        ][0]["exactly"]
    )


def test_function_service_aliases_the_gateway() -> None:
    svc = builders.build_function_service(FUNCTION, OperatorConfig())
    validate(svc)
    assert svc["metadata"]["namespace"] == "team-a"
    assert svc["spec"] == {
        "type": "ExternalName",
        "externalName": "lorafn-gateway.lorafn-system.svc.cluster.local",
    }
    assert svc["metadata"]["ownerReferences"][0]["kind"] == "LoRAFunction"
    assert builders.endpoint_url(OperatorConfig(), FunctionRef(namespace="team-a", name="french")) == (
        "http://lorafn-gateway.lorafn-system.svc.cluster.local/v1/functions/team-a/french:invoke"
    )


# --- decode CUDA-graph archives on a node volume (issue 11) ------------------------------------------


def _all_pods(config: OperatorConfig) -> dict[str, dict]:
    spec = BackboneSpec.model_validate(BACKBONE["spec"])
    slot = GPUSlot("node-1", 0, uuid="GPU-1234")
    fn_spec = LoRAFunctionSpec.model_validate(FUNCTION["spec"])
    ref = FunctionRef(namespace="team-a", name="french")
    return {
        "server": builders.build_server_pod(BACKBONE, spec, slot, config),
        "standby": builders.build_standby_pod(BACKBONE, spec, slot, 0, config, "q_proj:16"),
        "worker": builders.build_worker_pod(ref, 0, fn_spec, BACKBONE, spec, slot, config),
    }


def _env(pod: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_graph_archives_off_leave_the_pods_unchanged() -> None:
    """Off (the default, like the worker's own setting): no volume, no env, no init container; the pods
    are exactly the ones built with the archive settings left at their defaults."""
    off = _all_pods(OperatorConfig())
    assert off == _all_pods(OperatorConfig(graph_archives=False, graph_archive_claim="archives"))
    for pod in off.values():
        names = {v["name"] for v in pod["spec"]["volumes"]}
        assert builders.GRAPH_ARCHIVE_VOLUME not in names
        assert not any("GRAPH_ARCHIVE" in name for name in _env(pod))
        assert "initContainers" not in pod["spec"]


@pytest.mark.parametrize("mode", ["visibleDevices", "dra"])
def test_graph_archives_on_a_node_hostpath(mode: str) -> None:
    """On: every worker pod (standby and bound) mounts the node's directory read-write and gets the worker
    settings that turn archives on; the server only prepares the directory for uid 1000."""
    pods = _all_pods(OperatorConfig(gpu_sharing=mode, graph_archives=True))
    for kind in ("standby", "worker"):
        pod = pods[kind]
        validate(pod)
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == builders.GRAPH_ARCHIVE_VOLUME)
        assert volume["hostPath"] == {"path": "/var/lib/lorafn/graph-archives", "type": "DirectoryOrCreate"}
        mount = next(
            m
            for m in pod["spec"]["containers"][0]["volumeMounts"]
            if m["name"] == builders.GRAPH_ARCHIVE_VOLUME
        )
        assert mount == {"name": "graph-archives", "mountPath": builders.GRAPH_ARCHIVE_MOUNT}
        env = _env(pod)
        assert env["LORAFN_GRAPH_ARCHIVES"] == "true"
        assert env["LORAFN_GRAPH_ARCHIVE_DIR"] == builders.GRAPH_ARCHIVE_MOUNT
        assert "initContainers" not in pod["spec"]  # a worker's start pays nothing for the directory
    server = pods["server"]
    validate(server)
    assert not any("GRAPH_ARCHIVE" in name for name in _env(server))
    main_mounts = {m["name"] for m in server["spec"]["containers"][0]["volumeMounts"]}
    assert builders.GRAPH_ARCHIVE_VOLUME not in main_mounts  # the server reads no archive
    (init,) = server["spec"]["initContainers"]
    assert init["volumeMounts"] == [{"name": "graph-archives", "mountPath": builders.GRAPH_ARCHIVE_MOUNT}]
    assert init["command"][-2:] == [builders.GRAPH_ARCHIVE_MOUNT, "1000"]
    assert server["spec"]["securityContext"]["runAsUser"] == builders.WORKLOAD_UID
    sc = init["securityContext"]
    assert sc["runAsUser"] == 0 and sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert init["resources"]["requests"] and init["resources"]["limits"]


def test_graph_archives_on_a_claim_instead() -> None:
    pods = _all_pods(OperatorConfig(graph_archives=True, graph_archive_claim="graph-archives"))
    for kind in ("standby", "worker"):
        validate(pods[kind])
        volume = next(v for v in pods[kind]["spec"]["volumes"] if v["name"] == builders.GRAPH_ARCHIVE_VOLUME)
        assert volume == {"name": "graph-archives", "persistentVolumeClaim": {"claimName": "graph-archives"}}
        assert _env(pods[kind])["LORAFN_GRAPH_ARCHIVE_DIR"] == builders.GRAPH_ARCHIVE_MOUNT
    # fsGroup makes a claim writable by the workers: no root init container, no volume in the server
    assert "initContainers" not in pods["server"]["spec"]
    assert builders.GRAPH_ARCHIVE_VOLUME not in {v["name"] for v in pods["server"]["spec"]["volumes"]}


def _worker_settings(pod: dict, monkeypatch: pytest.MonkeyPatch):  # -> WorkerSettings
    """The real WorkerSettings as the pod's process builds it from exactly the pod's env."""
    from lorafn.runtime.worker import WorkerSettings

    for name in ("LORAFN_GRAPH_ARCHIVES", "LORAFN_GRAPH_ARCHIVE_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in _env(pod).items():
        if name.startswith("LORAFN_") and value is not None:
            monkeypatch.setenv(name, value)
    return WorkerSettings()


@pytest.mark.parametrize("claim", ["", "graph-archives"])
def test_the_worker_settings_read_the_archive_env(claim: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The env a worker pod gets, parsed by the real WorkerSettings: archives on, in the mounted dir."""
    pods = _all_pods(OperatorConfig(graph_archives=True, graph_archive_claim=claim))
    for kind in ("standby", "worker"):
        settings = _worker_settings(pods[kind], monkeypatch)
        assert settings.graph_archives is True
        assert settings.graph_archive_dir == builders.GRAPH_ARCHIVE_MOUNT
    off = _worker_settings(_all_pods(OperatorConfig())["worker"], monkeypatch)
    assert off.graph_archives is False and off.graph_archive_dir is None


def test_graph_archive_host_path_must_be_absolute() -> None:
    with pytest.raises(ValueError, match="graph_archive_host_path"):
        OperatorConfig(graph_archive_host_path="relative/dir")
