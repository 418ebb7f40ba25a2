"""The operator's one typed config (environment variables `LORAFN_OPERATOR_*`, set by the Helm chart).

The fields every component must agree on (Redis URL, key prefix, heartbeat TTL, cache root) are
inherited from `lorafn.api.settings.SharedSettings`, read here under the operator's own prefix
(`LORAFN_OPERATOR_REDIS_URL`, ...), and handed to the GPU pods under their shared names
(`LORAFN_REDIS_URL`, ...), so the operator and its pods cannot disagree.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from lorafn.api.settings import SharedSettings, TokenBuckets
from lorafn.api.uris import ClusterURIPolicy

GPUSharing = Literal["dra", "visibleDevices"]


def _resources(cpu: str, memory: str, memory_limit: str) -> dict[str, Any]:
    return {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory_limit}}


class OperatorConfig(SharedSettings):
    model_config = SettingsConfigDict(env_prefix="LORAFN_OPERATOR_", extra="ignore")

    namespace: str = Field(
        default="lorafn-system",
        description="namespace of the GPU pods (backbone servers, standby and bound workers) and DRA claims",
    )
    image: str = Field(default="ghcr.io/lorafn/lorafn:0.1.0", description="image of GPU pods")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    gpu_sharing: GPUSharing = Field(
        default="visibleDevices",
        description="how the pods of one GPU see the same device: a shared DRA ResourceClaim, or "
        "NVIDIA_VISIBLE_DEVICES=<GPU UUID> on a node with the NVIDIA container runtime",
    )
    dra_device_class: str = "gpu.nvidia.com"
    dra_api_version: str = "resource.k8s.io/v1"
    runtime_class_name: str | None = Field(default=None, description="e.g. nvidia (visibleDevices mode)")
    socket_host_dir: str = Field(default="/var/run/lorafn", description="hostPath root of the sockets")
    gpu_uuids_annotation: str = "lorafn.io/gpu-uuids"
    gpu_memory_label: str = "nvidia.com/gpu.memory"
    gpu_product_label: str = "nvidia.com/gpu.product"
    gpu_count_label: str = "nvidia.com/gpu.count"
    gateway_url: str = Field(
        default="http://lorafn-gateway.lorafn-system.svc.cluster.local",
        description="base URL of the gateway, for status.endpoint",
    )
    function_services: bool = Field(
        default=True,
        description="create an ExternalName Service lfn-<name> per function (alias of the gateway)",
    )
    pvc_root: str = Field(default="/mnt/pvc", description="where the operator pod mounts pvc:// claims")
    file_root: str = Field(
        default="",
        description="file:// model/adapter URIs (hostPath volumes of the node) are allowed only at or under "
        "this absolute directory; empty: refused (lorafn.api.uris.ClusterURIPolicy)",
    )
    pvc_access: dict[str, list[str]] = Field(
        default_factory=dict,
        description="claim -> namespaces whose LoRAFunctions may name pvc://<claim>/... ('*': all); "
        "functions in the release namespace may name any of its claims",
    )
    reconcile_interval_s: float = Field(default=10.0, gt=0, description="level-based re-check period")
    default_kv_mib: int = Field(
        default=256,
        ge=1,
        description="KV budget of a worker pod whose function names none (spec.resources), and of standby "
        "pods; the controller's LORAFN_DEFAULT_KV_MIB must match (the chart sets both from one value)",
    )
    retire_grace_s: float = Field(
        default=600.0,
        gt=0,
        description="a worker pod the controller stopped is deleted if it still runs this long after (it "
        "normally drains and ends by itself)",
    )
    # a bad value is refused when the operator starts, not by every worker pod at its start (a crash loop)
    prefill_graph_tokens: TokenBuckets = Field(
        default="",
        description="token buckets of prefill CUDA graphs in the worker pods, comma-separated "
        "(LORAFN_PREFILL_GRAPH_TOKENS, WorkerSettings.prefill_graph_tokens); empty: off, as in the worker: "
        "~132 MiB per 7B worker for 128/256/512 (docs/benchmarks.md)",
    )

    graph_archives: bool = Field(
        default=False,
        description="worker pods restore decode CUDA graphs from archives on a node volume "
        "(LORAFN_GRAPH_ARCHIVES); off by default like the worker's own setting: +142 MiB per worker, no gain "
        "yet in the 64-function replay (docs/benchmarks.md)",
    )
    graph_archive_host_path: str = Field(
        default="/var/lib/lorafn/graph-archives",
        description="directory of each GPU node holding the archives (hostPath, DirectoryOrCreate), shared "
        "by the node's worker pods; archives are keyed by GPU model, driver and versions: per node fits",
    )
    graph_archive_claim: str = Field(
        default="",
        description="a PersistentVolumeClaim (release namespace) holding the archives instead of hostPath",
    )
    workload_service_account: str = "lorafn-workload"
    server_resources: dict[str, Any] = Field(default_factory=lambda: _resources("1", "4Gi", "64Gi"))
    worker_resources: dict[str, Any] = Field(default_factory=lambda: _resources("1", "2Gi", "16Gi"))
    standby_resources: dict[str, Any] = Field(default_factory=lambda: _resources("500m", "2Gi", "16Gi"))
    # Where the operator talks to the API server; empty: in-cluster service account, then kubeconfig.
    kube_server: str = ""
    kube_token: str = ""
    kube_insecure: bool = False

    @field_validator("graph_archive_host_path")
    @classmethod
    def _absolute_host_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"graph_archive_host_path must be an absolute node path, not {value!r}")
        return value

    def uri_policy(self) -> ClusterURIPolicy:
        """Which model/adapter URIs resources may name on this cluster (issue 15)."""
        return ClusterURIPolicy.of(self.file_root, self.namespace, self.pvc_access)
