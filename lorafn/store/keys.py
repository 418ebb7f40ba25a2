"""The Redis key schema: one function per key, all under a deployment prefix.

Nothing else in lorafn spells a Redis key. Functions are addressed as the plain string
`namespace/name` (the store imports no other lorafn package; callers validate names with
`lorafn.api.FunctionRef`). Every key of a deployment starts with `<prefix>:`, so one Redis can hold
several deployments (tests use a random prefix each).
"""

from __future__ import annotations

import re

# The consumer group every request stream carries; each worker is one consumer of it.
GROUP = "workers"

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_FUNCTION_RE = re.compile(r"^[^\s/:{}]+/[^\s/:{}]+$")
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
# GPU ids (`local/0`, `<node>/<uuid>`) and adapter shape keys (`q_proj:16,v_proj:16`) in key names
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_.:,/=-]{1,256}$")


def check_function(function: str) -> str:
    """`function` when it is `namespace/name` without characters that would break the key schema."""
    if not isinstance(function, str) or not _FUNCTION_RE.match(function):
        raise ValueError(f"function {function!r} must be written namespace/name (no spaces, ':' or '{{}}')")
    return function


def check_id(value: str, what: str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise ValueError(f"{what} {value!r} must be 1-128 characters of [A-Za-z0-9_.-]")
    return value


def check_token(value: str, what: str) -> str:
    """`value` when it is 1-256 characters of [A-Za-z0-9_.:,/=-] (no spaces or braces)."""
    if not isinstance(value, str) or not _TOKEN_RE.match(value):
        raise ValueError(f"{what} {value!r} must be 1-256 characters of [A-Za-z0-9_.:,/=-]")
    return value


class Keys:
    """Key names of one deployment. Cheap to build; holds only the prefix."""

    def __init__(self, prefix: str = "lorafn") -> None:
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"key prefix {prefix!r} must be 1-64 characters of [A-Za-z0-9_.-]")
        self.prefix = prefix

    # -- registry ------------------------------------------------------------------------------
    def salt(self) -> str:
        """string: the per-deployment HMAC salt of API-key hashes (created once, SET NX)."""
        return f"{self.prefix}:salt"

    def functions(self) -> str:
        """set: every registered function (`namespace/name`)."""
        return f"{self.prefix}:functions"

    def function(self, function: str) -> str:
        """hash: the registration record of a function (spec JSON, model dir, limits)."""
        return f"{self.prefix}:fn:{check_function(function)}"

    def function_keys(self, function: str) -> str:
        """set: the API-key hashes that open this function."""
        return f"{self.function(function)}:keys"

    def api_keys(self) -> str:
        """hash: API-key hash -> the one function it opens."""
        return f"{self.prefix}:apikeys"

    # -- data plane ----------------------------------------------------------------------------
    def requests(self, function: str) -> str:
        """stream (consumer group `workers`): the function's pending invocations."""
        return f"{self.function(function)}:requests"

    def reply(self, request_id: str) -> str:
        """stream: the events of one request (accepted, deltas, restart, done/error); expires."""
        return f"{self.prefix}:reply:{check_id(request_id, 'request id')}"

    def cancel(self, request_id: str) -> str:
        """string with expiry: set when the client of a request went away; the worker holding it aborts it."""
        return f"{self.prefix}:cancel:{check_id(request_id, 'request id')}"

    # -- workers and control -------------------------------------------------------------------
    def function_workers(self, function: str) -> str:
        """sorted set: worker id -> last heartbeat (server ms) of the workers bound to the function."""
        return f"{self.function(function)}:workers"

    def workers(self) -> str:
        """sorted set: worker id -> last heartbeat (server ms), every worker of the deployment."""
        return f"{self.prefix}:workers"

    def worker(self, worker_id: str) -> str:
        """hash: a worker's self-description (function, pid, host, state); expires without heartbeats."""
        return f"{self.prefix}:worker:{check_id(worker_id, 'worker id')}"

    def control(self, worker_id: str) -> str:
        """stream: commands for one worker (`stop`, `drain`; `bind` is reserved for the warm pool)."""
        return f"{self.prefix}:control:{check_id(worker_id, 'worker id')}"

    def demand(self) -> str:
        """stream: cold-start demand (a request found no live worker); the supervisor consumes it."""
        return f"{self.prefix}:demand"

    def demand_guard(self, function: str) -> str:
        """string with expiry: set while a demand record for the function is fresh (deduplication)."""
        return f"{self.function(function)}:demand"

    # -- statistics and limits -----------------------------------------------------------------
    def stats(self, function: str) -> str:
        """hash: counters (requests, cold_requests, rate_limited, prompt_tokens, completion_tokens, errors,
        cancelled)."""
        return f"{self.function(function)}:stats"

    def arrivals(self, function: str, bucket: int) -> str:
        """integer with expiry: requests admitted in window `bucket` (= server seconds // bucket size)."""
        return f"{self.function(function)}:arrivals:{int(bucket)}"

    def rate_limit(self, function: str) -> str:
        """hash: the function's token bucket (tokens, ts)."""
        return f"{self.function(function)}:ratelimit"

    # -- backbones (local mode and the operator register them) ---------------------------------
    def backbones(self) -> str:
        """set: every registered backbone name."""
        return f"{self.prefix}:backbones"

    def backbone(self, name: str) -> str:
        """hash: a backbone's record (model_dir, dtype, spec JSON)."""
        return f"{self.prefix}:bb:{check_id(name, 'backbone name')}"

    # -- the controller (lorafn.controller) ------------------------------------------------------
    def controller_lease(self) -> str:
        """string with expiry: the id of the one active controller (SET NX PX, renewed by its holder)."""
        return f"{self.prefix}:controller:lease"

    def lifecycle(self) -> str:
        """stream: worker lifecycle events for the controller (bound, bind_failed, start_failed)."""
        return f"{self.prefix}:lifecycle"

    def function_status(self, function: str) -> str:
        """hash: what the controller knows of a function (wait reason, last cold start and its path,
        start failures); `lorafn status`, the operator and the gateway read it."""
        return f"{self.function(function)}:status"

    def pool(self) -> str:
        """hash: `<gpu>|<backbone>|<shape>` -> standby workers the controller wants there."""
        return f"{self.prefix}:pool"

    def gpus(self) -> str:
        """hash: GPU id -> JSON inventory (node, total bytes, backbones resident); written by whoever runs
        the backbone servers (`lorafn up`, the operator), read by the controller."""
        return f"{self.prefix}:gpus"

    # -- what the controller asks of the operator (Kubernetes: lorafn.controller.kube_executor) ----
    def desired_replicas(self, function: str) -> str:
        """string int: bound-worker pods the controller wants for the function (fresh starts it asked
        for; standby pods bound to it are not counted here). The operator holds it within
        [minReplicas, maxReplicas]; absent: minReplicas."""
        return f"{self.function(function)}:desired_replicas"

    def desired_standby(self, backbone: str) -> str:
        """hash: `<gpu>|<shape>` (`*`: shape-agnostic) -> pool pods the controller wants for the backbone
        there (standby ones, and those whose process got bound and still serves). A GPU with no field:
        the operator runs warmPool.minStandby agnostic ones; the total per GPU stays <= maxStandby."""
        return f"{self.backbone(backbone)}:desired_standby"

    def standby_kv(self, backbone: str) -> str:
        """hash: `<gpu>|<shape>` (as in `desired_standby`) -> the KV budget (MiB) the controller last granted
        a standby of the backbone there; the operator starts new pool pods of that field with it
        (`--kv-budget-mib`; absent: its default)."""
        return f"{self.backbone(backbone)}:standby_kv"

    def retiring(self) -> str:
        """sorted set: worker ids (= pod names) the controller stopped -> when (ms). The operator no longer
        counts their pods as replicas (so it deletes no other pod for them) and removes each pod once it
        has ended."""
        return f"{self.prefix}:retiring"

    def pool_workers(self) -> str:
        """hash: worker id -> `<backbone>|<gpu>|<shape>` of the workers that run in a pool (standby) pod,
        learnt while they heartbeat as standby; a stop of one lowers that pool count, not a function's."""
        return f"{self.prefix}:pool_workers"

    # -- SLO-aware batching (lorafn.store.admission, lua/gpu_admission.lua) ------------------------
    def gpu_slot(self, gpu: str) -> str:
        """hash: holders of the GPU's prefill slots: worker id -> `<lease end, server ms>|<handoff 0/1>`."""
        return f"{self.prefix}:gpu:{check_token(gpu, 'gpu')}:slot"

    def gpu_waiting(self, gpu: str) -> str:
        """hash: worker id -> `deadline_ms|t_ms|expires_ms|function` of the workers asking the slot."""
        return f"{self.prefix}:gpu:{check_token(gpu, 'gpu')}:waiting"

    def gpu_active(self, gpu: str) -> str:
        """sorted set: worker id -> last time (server ms) it had a running batch on the GPU."""
        return f"{self.prefix}:gpu:{check_token(gpu, 'gpu')}:active"

    def gpu_admissions(self, gpu: str) -> str:
        """stream (capped): the slot's grants (worker, function, margin_ms, active, waiters)."""
        return f"{self.prefix}:gpu:{check_token(gpu, 'gpu')}:admissions"

    def gpu_wake(self, gpu: str, worker_id: str | None = None) -> str:
        """list: a token pushed when the GPU's slot is handed to `worker_id`, which blocks on it while it
        waits (BLPOP); without `worker_id`, the prefix the Lua script appends a worker id to."""
        base = f"{self.prefix}:gpu:{check_token(gpu, 'gpu')}:wake:"
        return base if worker_id is None else base + check_id(worker_id, "worker id")

    def gpu_urgent(self, gpu: str) -> str:
        """hash: worker id -> lease end (server ms) of its urgent grant (decode gating)."""
        return f"{self.prefix}:gpu:{check_token(gpu, 'gpu')}:urgent"

    def gpu_paused(self, gpu: str) -> str:
        """set: worker ids whose decode step waits for the GPU's urgent grants to end (decode gating)."""
        return f"{self.prefix}:gpu:{check_token(gpu, 'gpu')}:paused"

    def gpu_gate_wake(self, gpu: str, worker_id: str | None = None) -> str:
        """list: a token pushed when the last urgent grant ends, which a paused worker blocks on (BLPOP);
        without `worker_id`, the prefix the Lua script appends a worker id to."""
        base = f"{self.prefix}:gpu:{check_token(gpu, 'gpu')}:gatewake:"
        return base if worker_id is None else base + check_id(worker_id, "worker id")

    def gpu_gating(self, gpu: str) -> str:
        """hash: decode gating counters (`urgent_grants`, `gated_steps`, `gated_ms`, `timeouts`, and per
        function `gated_steps|<function>` ...)."""
        return f"{self.prefix}:gpu:{check_token(gpu, 'gpu')}:gating"

    def latency_profile(self, backbone: str, gpu_model: str, shape: str) -> str:
        """hash: `<kind>.t0_ms`, `<kind>.alpha_ms`, `<kind>.samples` (kind: prefill, decode) of step
        latency on one backbone, GPU model and adapter shape."""
        parts = (check_token(backbone, "backbone"), check_token(gpu_model, "gpu model"))
        return f"{self.prefix}:profile:{parts[0]}|{parts[1]}|{check_token(shape, 'adapter shape')}"

    # -- offline batches: the OpenAI Files and Batch API (lorafn.store.batches, docs/batch.md) ------
    def file(self, file_id: str) -> str:
        """hash: a file's record (owner function, purpose, filename, bytes, created_at, path in the store)."""
        return f"{self.prefix}:file:{check_id(file_id, 'file id')}"

    def files(self, function: str) -> str:
        """sorted set: file id -> created_at (s) of the files of a function (uploaded or batch output)."""
        return f"{self.function(function)}:files"

    def batch(self, batch_id: str) -> str:
        """hash: a batch's record (the OpenAI batch object's fields; request counts)."""
        return f"{self.prefix}:batch:{check_id(batch_id, 'batch id')}"

    def batches(self, function: str) -> str:
        """sorted set: batch id -> created_at (s) of a function's batches."""
        return f"{self.function(function)}:batches"

    def active_batches(self) -> str:
        """set: ids of the batches the batch runner still works on (in progress or cancelling)."""
        return f"{self.prefix}:batches:active"

    def batch_results(self, batch_id: str) -> str:
        """hash: custom_id -> its output line (HSETNX: a request answered twice is written once)."""
        return f"{self.batch(batch_id)}:results"

    def batch_errors(self, batch_id: str) -> str:
        """hash: custom_id (or `#<line>` when it has none) -> its error-file line."""
        return f"{self.batch(batch_id)}:errors"

    def batch_inflight(self, batch_id: str) -> str:
        """hash: custom_id -> `<request id>|<attempt>` of the requests submitted and not yet answered."""
        return f"{self.batch(batch_id)}:inflight"

    def batch_backlog(self) -> str:
        """hash with expiry: function -> batch requests the runner holds but has not submitted yet (its
        backlog); rewritten whole by the active runner every tick, gone soon after it stops. The controller
        reads it as demand for more workers (docs/batch.md)."""
        return f"{self.prefix}:batches:backlog"

    def batch_runner_lease(self) -> str:
        """string with expiry: the gateway process whose batch runner is active (SET NX PX, renewed)."""
        return f"{self.prefix}:batch_runner:lease"
