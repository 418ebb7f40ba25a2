"""The resource specs every component shares: `Backbone` and `LoRAFunction` (group lorafn.io/v1alpha1).

Field names follow the Kubernetes (camelCase) spelling through aliases; Python code uses snake_case.
Validation lives here once: the CRD schemas, the operator and `lorafn apply` all refuse the same input.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from lorafn.api.uris import parse_uri

GROUP = "lorafn.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Kubernetes object names (DNS-1123 labels for namespaces and function names).
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_DNS_LABEL_RE = re.compile(DNS_LABEL_PATTERN)
# For the generated CRD schema only (the validators above give the messages): the same rule as a
# JSON-schema pattern, so that `kubectl apply` refuses a bad name before the operator sees it.
_DNS_LABEL_SCHEMA = {"pattern": DNS_LABEL_PATTERN, "maxLength": 63}


def check_dns_label(value: str, what: str) -> str:
    """Return `value` when it is a DNS-1123 label, else raise ValueError naming `what`."""
    if not isinstance(value, str) or not _DNS_LABEL_RE.match(value):
        raise ValueError(
            f"{what} {value!r} must be a DNS-1123 label: lower-case letters, digits and '-', "
            "at most 63 characters, starting and ending with a letter or digit"
        )
    return value


class _Spec(BaseModel):
    """Base: camelCase aliases, snake_case attributes, unknown fields refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def to_k8s(self) -> dict[str, Any]:
        """The Kubernetes (camelCase) form, without unset optional fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def _check_uri(value: str) -> str:
    parse_uri(value)
    return value


class ModelRef(_Spec):
    uri: str = Field(description="file:///path or pvc://<claim>/<path> of a model directory")

    _uri = field_validator("uri")(_check_uri)


class GPUDevice(_Spec):
    """One GPU named explicitly (instead of read off node annotations): where and which."""

    node: str = Field(min_length=1, max_length=253, description="node name (kubernetes.io/hostname)")
    uuid: str = Field(
        pattern=r"^(GPU|MIG)-[0-9a-fA-F-]+$",
        max_length=128,
        description="GPU UUID as nvidia-smi -L prints it (GPU-... or MIG-...)",
    )
    memory_mib: int | None = Field(
        default=None, ge=1, le=10_000_000, alias="memoryMiB", description="GPU memory in MiB, for status"
    )


class Placement(_Spec):
    node_selector: dict[str, str] = Field(default_factory=dict, description="nodes that hold a copy")
    gpus: int = Field(default=1, ge=1, le=64, description="GPUs per selected node that hold a copy")
    devices: list[GPUDevice] = Field(
        default_factory=list,
        max_length=1024,
        description="explicit GPUs (node + UUID); when set, nodeSelector and gpus are not used",
    )


class WarmPool(_Spec):
    min_standby: int = Field(default=1, ge=0, le=64, description="standby workers kept per GPU")
    max_standby: int = Field(default=4, ge=0, le=256, description="upper bound the planner may raise to")

    @model_validator(mode="after")
    def _bounds(self) -> WarmPool:
        if self.min_standby > self.max_standby:
            raise ValueError(
                f"warmPool.minStandby ({self.min_standby}) must be <= "
                f"warmPool.maxStandby ({self.max_standby})"
            )
        return self


Dtype = Literal["bfloat16", "float16", "float32"]


class BackboneSpec(_Spec):
    """`Backbone` (cluster-scoped): a base model loaded once per GPU and shared read-only."""

    model: ModelRef = Field(description="where the model directory (safetensors + config.json) lies")
    dtype: Dtype = Field(default="bfloat16", description="dtype of the shared weights on the GPU")
    placement: Placement = Field(default_factory=Placement, description="which GPUs hold a copy")
    warm_pool: WarmPool = Field(default_factory=WarmPool, description="standby workers per GPU")
    adapter_slots: int = Field(
        default=1,
        ge=1,
        le=64,
        description="adapters one worker process serves in one batch (opt-in; 1: one function per process). "
        "Above 1, functions of one namespace on this backbone share a worker: a function's cold start joins "
        "a live worker of its namespace with a free slot (milliseconds, no new process), and their decode "
        "steps read the backbone once for all of them. They share that process's faults and KV budget; "
        "other namespaces never share it",
    )


class AdapterRef(_Spec):
    uri: str = Field(description="file:///path or pvc://<claim>/<path> of a PEFT adapter directory")

    _uri = field_validator("uri")(_check_uri)


class SLO(_Spec):
    ttft_ms: int = Field(default=1000, ge=1, le=600_000, description="time-to-first-token target")
    tpot_ms: int | None = Field(default=None, ge=1, le=60_000, description="time-per-output-token target")


class Scaling(_Spec):
    min_replicas: int = Field(
        default=0, ge=0, le=1000, description="bound workers kept warm (0: scale to zero)"
    )
    max_replicas: int = Field(
        default=1, ge=1, le=1000, description="most bound workers the controller may ask"
    )
    keep_alive_seconds: int = Field(
        default=60,
        ge=0,
        le=86_400,
        description="idle seconds before a bound worker exits; where the platform parks idle workers "
        "(its KV cache released, the process kept: by default after 50 s idle, or when memory is short), a "
        "parked one exits by the platform's parked keep-alive instead (300 s by default)",
    )

    @model_validator(mode="after")
    def _bounds(self) -> Scaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"scaling.minReplicas ({self.min_replicas}) must be <= scaling.maxReplicas "
                f"({self.max_replicas})"
            )
        return self


class Resources(_Spec):
    """One worker's GPU memory budget (its KV cache), granted by the controller out of the GPU's account.

    Either a KV size in MiB, or the concurrency it must hold (sequences x context tokens); neither:
    the controller's default. A worker sizes its KV cache from this, never from the GPU's free memory.
    """

    kv_cache_mib: int | None = Field(
        default=None, ge=1, le=1_048_576, alias="kvCacheMiB", description="KV-cache size of a worker, MiB"
    )
    max_concurrent_sequences: int | None = Field(
        default=None, ge=1, le=1024, description="sequences one worker runs at once (with maxContextTokens)"
    )
    max_context_tokens: int | None = Field(
        default=None, ge=16, le=1_048_576, description="tokens per sequence (prompt + output) to hold in KV"
    )

    @model_validator(mode="after")
    def _one_way(self) -> Resources:
        by_shape = (self.max_concurrent_sequences, self.max_context_tokens)
        if self.kv_cache_mib is not None and any(v is not None for v in by_shape):
            raise ValueError(
                "resources: give either kvCacheMiB or maxConcurrentSequences x maxContextTokens, not both"
            )
        if (by_shape[0] is None) != (by_shape[1] is None):
            raise ValueError("resources: maxConcurrentSequences and maxContextTokens go together")
        return self


class GenerationDefaults(_Spec):
    max_tokens: int = Field(default=256, ge=1, le=32_768, description="default max_tokens of a request")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="default sampling temperature")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="default nucleus sampling mass")
    top_k: int = Field(default=0, ge=0, le=100_000, description="0 disables top-k")
    stop: list[str] = Field(default_factory=list, max_length=16, description="default stop strings")


class SecretKeyRef(_Spec):
    name: str = Field(json_schema_extra=_DNS_LABEL_SCHEMA, description="Secret in the function's namespace")
    key: str = Field(
        default="api-keys",
        min_length=1,
        max_length=253,
        description="key of the Secret holding the API keys, one per line",
    )

    _name = field_validator("name")(lambda v: check_dns_label(v, "auth.apiKeySecretRef.name"))


class Auth(_Spec):
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret (in the function's namespace) whose key holds the API keys"
    )


class LoRAFunctionSpec(_Spec):
    """`LoRAFunction` (namespaced): backbone + adapter + SLO + scaling; invoked as `namespace/name`."""

    backbone: str = Field(
        json_schema_extra=_DNS_LABEL_SCHEMA, description="name of the Backbone (cluster-scoped)"
    )
    adapter: AdapterRef = Field(description="where the PEFT LoRA adapter directory lies")
    slo: SLO = Field(default_factory=SLO, description="latency targets")
    scaling: Scaling = Field(default_factory=Scaling, description="bounds of the bound workers")
    resources: Resources = Field(
        default_factory=Resources, description="one worker's KV-cache budget (default: the controller's)"
    )
    generation: GenerationDefaults = Field(
        default_factory=GenerationDefaults, description="defaults for requests that leave them out"
    )
    auth: Auth = Field(default_factory=Auth, description="API keys; without them any caller is admitted")

    _backbone = field_validator("backbone")(lambda v: check_dns_label(v, "backbone"))


class FunctionRef(BaseModel):
    """`namespace/name`, the address of a function everywhere (HTTP `model`, Redis keys, CLI)."""

    model_config = ConfigDict(frozen=True)

    namespace: str
    name: str

    @model_validator(mode="after")
    def _labels(self) -> FunctionRef:
        check_dns_label(self.namespace, "namespace")
        check_dns_label(self.name, "function name")
        return self

    @classmethod
    def parse(cls, text: str) -> FunctionRef:
        namespace, sep, name = text.partition("/")
        if not sep or "/" in name:
            raise ValueError(f"function {text!r} must be written namespace/name")
        return cls(namespace=namespace, name=name)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"
