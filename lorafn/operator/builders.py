"""Pure builders of the Kubernetes objects the operator owns: dicts in, dicts out, no I/O.

Layout (docs/operator.md, and "Operator" in docs/architecture.md): every GPU pod lives in the
operator's workload namespace, because a DRA ResourceClaim can only be shared by pods of its own
namespace. Per selected GPU ("slot"):

    <backbone>-<slot>-server         the backbone server (restartPolicy Always)
    <backbone>-<slot>-standby-<k>    tenant-neutral standby workers (warmPool), k = 0..n-1
    <backbone>-<slot>-gpu            the shared ResourceClaim (gpuSharing=dra)

and per function replica i: `fn-<namespace>-<name>-<hash>-<i>` on slot i mod #slots. GPU pods are owned
by the Backbone (cluster-scoped owners are allowed for namespaced objects); a function's workers are
found by labels and removed by its finalizer; its ExternalName Service lives in its own namespace and
is owned by it. Names are deterministic, so a restarted operator finds what it made.

Over 450 lines on purpose: every object the operator creates (names, labels, GPU selection, pods,
claims, services) is built here, so one file shows the whole layout and no other module builds one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from lorafn.api.settings import env_name
from lorafn.api.specs import API_VERSION, BackboneSpec, FunctionRef, LoRAFunctionSpec
from lorafn.api.uris import PVC_MOUNT_ROOT, parse_uri
from lorafn.operator.config import OperatorConfig

MANAGED_BY = "lorafn-operator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_BACKBONE = "lorafn.io/backbone"
LABEL_SLOT = "lorafn.io/slot"
LABEL_FN_NAMESPACE = "lorafn.io/function-namespace"
LABEL_FN_NAME = "lorafn.io/function-name"
LABEL_REPLICA = "lorafn.io/replica"
LABEL_SHAPE = "lorafn.io/shape"  # of a pool pod: `any`, or a hash of the adapter shape it prepares
ANNOTATION_SHAPE = "lorafn.io/shape"
ANNOTATION_GPU_UUID = "lorafn.io/gpu-uuid"

COMPONENT_SERVER = "backbone-server"
COMPONENT_STANDBY = "standby-worker"
COMPONENT_WORKER = "worker"

SOCKET_MOUNT = "/run/lorafn"
# Decode CUDA-graph archives (issue 11; config.graph_archives): one directory per node, mounted read-write
# here in every worker pod (LORAFN_GRAPH_ARCHIVE_DIR). The worker writes atomically (temp file + rename) and
# refuses an archive whose key (GPU model, driver, software versions, backbone, adapter shape, ...) differs.
GRAPH_ARCHIVE_MOUNT = "/var/lib/lorafn/graph-archives"
GRAPH_ARCHIVE_VOLUME = "graph-archives"
WORKLOAD_UID = 1000  # every GPU pod's user and group (the pod securityContext below)
FINALIZER = "lorafn.io/cleanup"

# The commands the image runs: `lorafn backbone-server serve` (configured by its options only) and
# `lorafn worker serve` (configured by its settings class, environment `LORAFN_*`: the env below is
# built from that class's field names with `env_name`). tests/operator/test_pod_contract.py parses
# every command line built here with the real `lorafn` CLI and checks each env name against the
# target's settings fields.
SOCKET_PATH = "/run/lorafn/backbone.sock"
SERVER_HTTP_PORT = 8081
WORKER_COMMAND = ["lorafn", "worker", "serve", "--device", "cuda"]
# Read by the NVIDIA container runtime and by libraries (caches under $HOME), not by lorafn settings.
EXTERNAL_ENV = ("HOME", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES")


def short_hash(text: str, length: int = 6) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def bounded(name: str, max_len: int) -> str:
    """`name` if short enough, else a prefix plus a hash of the whole (names stay unique and stable)."""
    if len(name) <= max_len:
        return name
    return f"{name[: max_len - 7].rstrip('-')}-{short_hash(name)}"


@dataclass(frozen=True)
class GPUSlot:
    """One GPU chosen to hold a copy of a backbone."""

    node: str
    index: int
    uuid: str | None = None
    product: str | None = None
    memory_mib: int | None = None

    @property
    def slot_id(self) -> str:
        return short_hash(f"{self.node}/{self.index}", 8)

    @property
    def gpu_id(self) -> str:
        """The GPU's id in the controller's inventory and in its workers' heartbeats: `<node>/<uuid>`
        (`<node>/<index>` when the UUID is unknown, e.g. DRA without placement.devices)."""
        return f"{self.node}/{self.uuid or self.index}"


@dataclass(frozen=True)
class SlotProblem:
    reason: str
    message: str


# --- names ------------------------------------------------------------------------------------------


def server_pod_name(backbone: str, slot: GPUSlot) -> str:
    return f"{bounded(backbone, 40)}-{slot.slot_id}-server"


def shape_label(shape: str | None) -> str:
    """Label value of a pool pod's adapter shape (a shape key is no valid label value: a hash of it)."""
    return short_hash(shape, 8) if shape else "any"


def standby_pod_name(backbone: str, slot: GPUSlot, k: int, shape: str | None = None) -> str:
    """`<bb>-<slot>-standby-<k>`, or `<bb>-<slot>-standby-<shape hash>-<k>` when prepared for a shape."""
    middle = f"standby-{shape_label(shape)}" if shape else "standby"
    return f"{bounded(backbone, 40)}-{slot.slot_id}-{middle}-{k}"


def claim_name(backbone: str, slot: GPUSlot) -> str:
    return f"{bounded(backbone, 40)}-{slot.slot_id}-gpu"


def worker_pod_name(ref: FunctionRef, replica: int) -> str:
    return f"fn-{bounded(f'{ref.namespace}-{ref.name}', 40)}-{short_hash(str(ref))}-{replica}"


def function_service_name(ref: FunctionRef) -> str:
    # A Service name is a DNS-1035 label (starts with a letter): hence the prefix.
    return bounded(f"lfn-{ref.name}", 63)


def endpoint_url(config: OperatorConfig, ref: FunctionRef) -> str:
    return f"{config.gateway_url.rstrip('/')}/v1/functions/{ref.namespace}/{ref.name}:invoke"


# --- GPU selection ----------------------------------------------------------------------------------


def _int_or_none(value: Any) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def select_gpu_slots(
    spec: BackboneSpec, nodes: list[dict[str, Any]], config: OperatorConfig
) -> tuple[list[GPUSlot], list[SlotProblem]]:
    """The GPUs that hold a copy: `spec.placement.devices`, else `gpus` per node matching nodeSelector.

    UUIDs come from the node annotation `lorafn.io/gpu-uuids` (comma-separated, in index order, as
    `nvidia-smi --query-gpu=uuid --format=csv,noheader` prints them); memory and product from the
    GPU feature discovery labels. visibleDevices mode needs a UUID per slot; DRA mode does not.
    """
    problems: list[SlotProblem] = []
    by_name = {(n.get("metadata") or {}).get("name"): n for n in nodes}
    if spec.placement.devices:
        slots: list[GPUSlot] = []
        per_node: dict[str, int] = {}
        for device in spec.placement.devices:
            index = per_node.get(device.node, 0)
            per_node[device.node] = index + 1
            labels = ((by_name.get(device.node) or {}).get("metadata") or {}).get("labels") or {}
            slots.append(
                GPUSlot(
                    node=device.node,
                    index=index,
                    uuid=device.uuid,
                    product=labels.get(config.gpu_product_label),
                    memory_mib=device.memory_mib or _int_or_none(labels.get(config.gpu_memory_label)),
                )
            )
            if device.node not in by_name:
                problems.append(
                    SlotProblem("NodeNotFound", f"node {device.node!r} of placement.devices not found")
                )
        return slots, problems

    selector = spec.placement.node_selector
    slots = []
    matched = 0
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        meta = node.get("metadata") or {}
        labels = meta.get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()):
            continue
        matched += 1
        uuids = [
            u.strip() for u in (meta.get("annotations") or {}).get(config.gpu_uuids_annotation, "").split(",")
        ]
        uuids = [u for u in uuids if u]
        available = _int_or_none(labels.get(config.gpu_count_label))
        if available is None:
            available = _int_or_none(
                ((node.get("status") or {}).get("allocatable") or {}).get("nvidia.com/gpu")
            )
        if available is None:
            available = len(uuids)
        count = min(spec.placement.gpus, available)
        if count < spec.placement.gpus:
            problems.append(
                SlotProblem(
                    "InsufficientGPUs",
                    f"node {meta['name']} has {available} GPU(s); placement.gpus asks {spec.placement.gpus}",
                )
            )
        for index in range(count):
            uuid = uuids[index] if index < len(uuids) else None
            if uuid is None and config.gpu_sharing == "visibleDevices":
                problems.append(
                    SlotProblem(
                        "NoGPUUUID",
                        f"node {meta['name']} GPU {index}: no UUID in annotation "
                        f"{config.gpu_uuids_annotation} (needed by gpuSharing=visibleDevices; "
                        "or name the GPUs in placement.devices)",
                    )
                )
                continue
            slots.append(
                GPUSlot(
                    node=meta["name"],
                    index=index,
                    uuid=uuid,
                    product=labels.get(config.gpu_product_label),
                    memory_mib=_int_or_none(labels.get(config.gpu_memory_label)),
                )
            )
    if matched == 0:
        problems.append(SlotProblem("NoMatchingNodes", f"no node matches placement.nodeSelector {selector}"))
    return slots, problems


# --- objects ----------------------------------------------------------------------------------------


def owner_reference(body: dict[str, Any], kind: str) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _labels(component: str, **extra: str) -> dict[str, str]:
    return {
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: "lorafn",
        LABEL_COMPONENT: component,
        **extra,
    }


def pod_path(uri: str) -> str:
    """Where a model/adapter URI is visible inside the GPU pods (and so in the Redis records)."""
    return _artifact_volume(uri, "x")[2]


def _artifact_volume(uri: str, name: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(volume, mount, path in the pod) for a model/adapter URI: hostPath for file://, PVC for pvc://.

    In a cluster a file:// URI names a directory on the node (e.g. a node-local model cache).
    """
    parsed = parse_uri(uri)
    if parsed.scheme == "file":
        volume = {"name": name, "hostPath": {"path": parsed.path, "type": "Directory"}}
        mount = {"name": name, "mountPath": parsed.path, "readOnly": True}
        return volume, mount, parsed.path
    root = f"{PVC_MOUNT_ROOT}/{parsed.claim}"
    volume = {"name": name, "persistentVolumeClaim": {"claimName": parsed.claim, "readOnly": True}}
    mount = {"name": name, "mountPath": root, "readOnly": True}
    return volume, mount, parsed.local_path()


def _gpu_pod(
    *,
    name: str,
    config: OperatorConfig,
    backbone: str,
    backbone_spec: BackboneSpec,
    slot: GPUSlot,
    labels: dict[str, str],
    owner: dict[str, Any] | None,
    args: list[str],
    env: list[dict[str, Any]],
    resources: dict[str, Any],
    restart_policy: str,
    extra_volumes: list[tuple[dict[str, Any], dict[str, Any]]] = (),  # type: ignore[assignment]
    readiness: dict[str, Any] | None = None,
    init_containers: list[dict[str, Any]] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    model_volume, model_mount, _ = _artifact_volume(backbone_spec.model.uri, "model")
    volumes = [
        {
            "name": "sockets",
            "hostPath": {
                "path": f"{config.socket_host_dir.rstrip('/')}/{backbone}/{slot.slot_id}",
                "type": "DirectoryOrCreate",
            },
        },
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        model_volume,
    ]
    mounts = [
        {"name": "sockets", "mountPath": SOCKET_MOUNT},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        model_mount,
    ]
    for volume, mount in extra_volumes:
        if all(v["name"] != volume["name"] for v in volumes):
            volumes.append(volume)
        mounts.append(mount)
    env = [
        {"name": "HOME", "value": "/tmp"},  # caches under a writable dir (read-only root filesystem)
        *env,
    ]
    container_resources: dict[str, Any] = {k: dict(v) for k, v in resources.items()}
    pod_spec: dict[str, Any] = {
        "restartPolicy": restart_policy,
        "serviceAccountName": config.workload_service_account,
        "automountServiceAccountToken": False,
        "nodeSelector": {"kubernetes.io/hostname": slot.node},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": WORKLOAD_UID,
            "runAsGroup": WORKLOAD_UID,
            "fsGroup": WORKLOAD_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumes": volumes,
        "containers": [
            {
                "name": "main",
                "image": config.image,
                "imagePullPolicy": config.image_pull_policy,
                "args": args,
                "env": env,
                "resources": container_resources,
                "volumeMounts": mounts,
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
    }
    if readiness is not None:
        pod_spec["containers"][0]["readinessProbe"] = readiness
    if init_containers:
        pod_spec["initContainers"] = list(init_containers)
    if config.gpu_sharing == "dra":
        pod_spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim_name(backbone, slot)}]
        container_resources["claims"] = [{"name": "gpu"}]
    else:
        env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": slot.uuid or ""})
        env.append({"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"})
        if config.runtime_class_name:
            pod_spec["runtimeClassName"] = config.runtime_class_name
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": config.namespace,
        "labels": labels,
        "annotations": {ANNOTATION_GPU_UUID: slot.uuid or ""},
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def graph_archive_volume(config: OperatorConfig) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, mount) of the node's graph-archive directory in worker pods; None when archives are off.

    Per node because an archive only serves processes of the same key (GPU model, driver, CUDA/torch/triton
    versions, ...): the pods of one node share them, another node may have another GPU or driver. A claim,
    when configured, replaces the hostPath (a refused archive costs a capture, never a wrong graph).
    """
    if not config.graph_archives:
        return None
    if config.graph_archive_claim:
        source: dict[str, Any] = {"persistentVolumeClaim": {"claimName": config.graph_archive_claim}}
    else:
        source = {"hostPath": {"path": config.graph_archive_host_path, "type": "DirectoryOrCreate"}}
    volume = {"name": GRAPH_ARCHIVE_VOLUME, **source}
    return volume, {"name": GRAPH_ARCHIVE_VOLUME, "mountPath": GRAPH_ARCHIVE_MOUNT}


def _graph_archive_env(config: OperatorConfig) -> dict[str, str]:
    """Worker settings turning archives on (WorkerSettings.graph_archives / graph_archive_dir)."""
    if not config.graph_archives:
        return {}
    return {"graph_archives": "true", "graph_archive_dir": GRAPH_ARCHIVE_MOUNT}


def _graph_archive_init(config: OperatorConfig) -> list[dict[str, Any]]:
    """The backbone server's init container that hands the node's archive directory to the workers' user.

    The kubelet creates a DirectoryOrCreate hostPath as root with mode 0755, and fsGroup does not apply to
    hostPath: without this, workers (uid 1000) could read archives but never write one. It runs as root
    with CAP_CHOWN only, once per server start (the server of a GPU starts before its workers can build a
    decode state, which needs its socket), so worker starts pay nothing. A claim needs none (fsGroup).
    """
    if not config.graph_archives or config.graph_archive_claim:
        return []
    return [
        {
            "name": "graph-archive-dir",
            "image": config.image,
            "imagePullPolicy": config.image_pull_policy,
            "command": [
                "python3",
                "-c",
                "import os, sys; os.chown(sys.argv[1], int(sys.argv[2]), int(sys.argv[2]))",
                GRAPH_ARCHIVE_MOUNT,
                str(WORKLOAD_UID),
            ],
            "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
            "volumeMounts": [{"name": GRAPH_ARCHIVE_VOLUME, "mountPath": GRAPH_ARCHIVE_MOUNT}],
            "securityContext": {
                "runAsUser": 0,
                "runAsNonRoot": False,
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
            },
        }
    ]


def settings_env(**values: str) -> list[dict[str, Any]]:
    """Container env setting these settings fields (`redis_url=...` -> `LORAFN_REDIS_URL`)."""
    return [{"name": env_name(field), "value": value} for field, value in values.items()]


def _worker_env(config: OperatorConfig, spec: BackboneSpec, **values: str) -> list[dict[str, Any]]:
    """What every worker pod (standby or bound) reads: where Redis is and the backbone it maps."""
    return [
        *settings_env(
            redis_url=config.redis_url,
            key_prefix=config.key_prefix,
            heartbeat_ttl_s=str(config.heartbeat_ttl_s),
            model=pod_path(spec.model.uri),
            dtype=spec.dtype,
            backbone_socket=SOCKET_PATH,
            **_graph_archive_env(config),
            **({"prefill_graph_tokens": config.prefill_graph_tokens} if config.prefill_graph_tokens else {}),
            **values,
        ),
        # The pod name is the worker id: `kubectl logs <worker id>` finds its log.
        {"name": env_name("worker_id"), "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]


def _worker_volumes(config: OperatorConfig) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Volumes every worker pod (standby or bound) mounts besides the model's and the sockets."""
    archive = graph_archive_volume(config)
    return [archive] if archive is not None else []


def build_server_pod(
    backbone_body: dict[str, Any], spec: BackboneSpec, slot: GPUSlot, config: OperatorConfig
) -> dict[str, Any]:
    """The backbone server of one GPU: loads the weights once and exports them over the socket."""
    backbone = backbone_body["metadata"]["name"]
    init = _graph_archive_init(config)
    pod = _gpu_pod(
        name=server_pod_name(backbone, slot),
        config=config,
        backbone=backbone,
        backbone_spec=spec,
        slot=slot,
        labels=_labels(COMPONENT_SERVER, **{LABEL_BACKBONE: backbone, LABEL_SLOT: slot.slot_id}),
        owner=owner_reference(backbone_body, "Backbone"),
        args=[
            "lorafn",
            "backbone-server",
            "serve",
            "--model",
            pod_path(spec.model.uri),
            "--socket",
            SOCKET_PATH,
            "--device",
            "cuda",
            "--http-host",
            "0.0.0.0",
            "--http-port",
            str(SERVER_HTTP_PORT),
        ],
        env=[],
        resources=config.server_resources,
        restart_policy="Always",
        init_containers=init,
        readiness={
            "httpGet": {"path": "/readyz", "port": SERVER_HTTP_PORT},
            "periodSeconds": 2,
            "failureThreshold": 3,
        },
    )
    archive = graph_archive_volume(config)
    if init and archive is not None:  # for the init container only: the server reads no archive
        pod["spec"]["volumes"].append(archive[0])
    return pod


def build_standby_pod(
    backbone_body: dict[str, Any],
    spec: BackboneSpec,
    slot: GPUSlot,
    k: int,
    config: OperatorConfig,
    shape: str | None = None,
    kv_budget_mib: int | None = None,
) -> dict[str, Any]:
    """A tenant-neutral standby worker on one GPU (prepared for adapter `shape` when given: its graphs are
    ready for it); once bound it serves one function and then exits. `kv_budget_mib`: its KV budget, the
    one the controller granted the GPU's standbys of that shape (`<bb>:standby_kv`: sized for the largest
    function they are kept for; a standby with less can never take a function that asks for more), else
    the default."""
    backbone = backbone_body["metadata"]["name"]
    pod = _gpu_pod(
        name=standby_pod_name(backbone, slot, k, shape),
        config=config,
        backbone=backbone,
        backbone_spec=spec,
        slot=slot,
        labels=_labels(
            COMPONENT_STANDBY,
            **{LABEL_BACKBONE: backbone, LABEL_SLOT: slot.slot_id, LABEL_SHAPE: shape_label(shape)},
        ),
        owner=owner_reference(backbone_body, "Backbone"),
        # Tenant-neutral: bound later by the controller (`bind` on its control stream). A bound process
        # stays in this pod and exits after keep-alive (or a `stop`) with code 0: OnFailure lets the pod
        # end then (the operator replaces it with a fresh pod while the pool count asks for one), so no
        # process that served a tenant ever waits in the pool; a crash restarts the container under
        # the kubelet's backoff instead of a new pod every reconcile (docs/operator.md#standby-pods).
        args=[
            *WORKER_COMMAND,
            "--gpu",
            slot.gpu_id,
            "--kv-budget-mib",
            str(kv_budget_mib or config.default_kv_mib),
            "--standby",
            "--backbone",
            backbone,
            *(["--shape", shape] if shape else []),
            # adapter slots are sized by a shape (docs/runtime.md#adapter-slots)
            *(["--adapter-slots", str(spec.adapter_slots)] if shape and spec.adapter_slots > 1 else []),
        ],
        env=_worker_env(config, spec),
        resources=config.standby_resources,
        restart_policy="OnFailure",
        extra_volumes=_worker_volumes(config),
    )
    if shape:
        pod["metadata"]["annotations"][ANNOTATION_SHAPE] = shape
    return pod


def build_worker_pod(
    ref: FunctionRef,
    replica: int,
    fn_spec: LoRAFunctionSpec,
    backbone_body: dict[str, Any],
    backbone_spec: BackboneSpec,
    slot: GPUSlot,
    config: OperatorConfig,
    kv_budget_mib: int | None = None,
) -> dict[str, Any]:
    """Bound worker `replica` of a function, on one GPU that holds its backbone. `kv_budget_mib`: its KV
    budget (the function's spec.resources, else the default; never sized from the GPU's free memory); on a
    backbone with adapter slots, that times the slots (the functions that may join it bring theirs)."""
    backbone = backbone_body["metadata"]["name"]
    kv_mib = (kv_budget_mib or config.default_kv_mib) * backbone_spec.adapter_slots
    adapter_volume, adapter_mount, adapter_path = _artifact_volume(fn_spec.adapter.uri, "adapter")
    return _gpu_pod(
        name=worker_pod_name(ref, replica),
        config=config,
        backbone=backbone,
        backbone_spec=backbone_spec,
        slot=slot,
        labels=_labels(
            COMPONENT_WORKER,
            **{
                LABEL_BACKBONE: backbone,
                LABEL_SLOT: slot.slot_id,
                LABEL_FN_NAMESPACE: ref.namespace,
                LABEL_FN_NAME: ref.name,
                LABEL_REPLICA: str(replica),
            },
        ),
        # Owned by the Backbone: an owner must be cluster-scoped or in the pod's namespace, and the
        # function lives elsewhere. Its finalizer deletes these pods.
        owner=owner_reference(backbone_body, "Backbone"),
        args=[
            *WORKER_COMMAND,
            "--gpu",
            slot.gpu_id,
            "--kv-budget-mib",
            str(kv_mib),
            "--function",
            str(ref),
            *(
                ["--adapter-slots", str(backbone_spec.adapter_slots)]
                if backbone_spec.adapter_slots > 1
                else []
            ),
        ],
        env=_worker_env(
            config,
            backbone_spec,
            function=str(ref),
            adapter=adapter_path,
            keep_alive_seconds=str(fn_spec.scaling.keep_alive_seconds),
        ),
        resources=config.worker_resources,
        restart_policy="Never",
        extra_volumes=[(adapter_volume, adapter_mount), *_worker_volumes(config)],
    )


def build_resource_claim(
    backbone_body: dict[str, Any], slot: GPUSlot, config: OperatorConfig
) -> dict[str, Any]:
    """The DRA claim that the server and workers of one slot share (gpuSharing=dra)."""
    backbone = backbone_body["metadata"]["name"]
    exactly: dict[str, Any] = {
        "deviceClassName": config.dra_device_class,
        "allocationMode": "ExactCount",
        "count": 1,
    }
    if slot.uuid:
        exactly["selectors"] = [
            {"cel": {"expression": f'device.attributes["{config.dra_device_class}"].uuid == "{slot.uuid}"'}}
        ]
    return {
        "apiVersion": config.dra_api_version,
        "kind": "ResourceClaim",
        "metadata": {
            "name": claim_name(backbone, slot),
            "namespace": config.namespace,
            "labels": _labels("gpu-claim", **{LABEL_BACKBONE: backbone, LABEL_SLOT: slot.slot_id}),
            "ownerReferences": [owner_reference(backbone_body, "Backbone")],
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def build_function_service(fn_body: dict[str, Any], config: OperatorConfig) -> dict[str, Any]:
    """`lfn-<name>` in the function's namespace: a DNS alias of the gateway, owned by the function."""
    meta = fn_body["metadata"]
    ref = FunctionRef(namespace=meta["namespace"], name=meta["name"])
    host = config.gateway_url.split("://", 1)[-1].split("/", 1)[0].split(":", 1)[0]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": function_service_name(ref),
            "namespace": ref.namespace,
            "labels": _labels("function", **{LABEL_FN_NAMESPACE: ref.namespace, LABEL_FN_NAME: ref.name}),
            "annotations": {"lorafn.io/endpoint": endpoint_url(config, ref)},
            "ownerReferences": [owner_reference(fn_body, "LoRAFunction")],
        },
        "spec": {"type": "ExternalName", "externalName": host},
    }
