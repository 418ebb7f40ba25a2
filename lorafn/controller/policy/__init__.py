"""Pure policy of the controller: no torch, no Kubernetes, no Redis (import-linter enforces it).

The driver (Redis, local supervisor, operator) builds a `Snapshot` each round and applies the `Plan`
that `decide` returns; everything here is a deterministic function of the snapshot.

In (model.py, frozen dataclasses; bytes are ints, durations seconds, rates requests/s):
- `GPU(id, node, total_bytes, backbones={name: bytes resident}, other_bytes, reserve_bytes)`
- `Worker(id, gpu, backbone, state, shape, function, mem_bytes, idle_s, running, age_s)`;
  state "starting" | "standby" | "bound" | "draining"; shape None = shape-agnostic; function None
  on a standby (or a worker starting as one); mem_bytes = its whole reservation.
- `Function(name, backbone, shape, mem_bytes, min_replicas, max_replicas, keep_alive_s,
  ttft_slo_ms, arrival_rate, queued, oldest_wait_s, start_failures, last_failure_s, last_failure)`
- `Backbone(name, bytes, min_standby_per_gpu, max_standby_per_gpu, gpus)`: a GPU *holds* it when
  the GPU lists it in ``backbones`` and ``gpus`` is empty or names the GPU.
- `Costs(fresh_start_s, bind_s, capture_s, default_standby_bytes, standby_bytes={shape: bytes})`
- `Snapshot(now_s, gpus, backbones, workers, functions, costs)`; `PolicyConfig` (config.py).

Out (actions.py): `Plan(actions, pool, account)`:
- `actions`, in the order to apply them (a Stop that makes room comes before its Start):
  `Bind(worker_id, function, gpu, prepared)`, `Start(gpu, backbone, shape, function, mem_bytes,
  reason)` (function None = a standby), `Stop(worker_id, reason, gpu, detail)` with reason
  "offload" | "scale_down" | "pool_shrink" | "keep_alive", `Wait(function, reason)` (no worker this
  round; the reason is for the function's waiting clients and its status); with ``park_idle`` (off; the
  driver refuses it until workers can park), `Park(worker_id, function, gpu, release_bytes)` and
  `Unpark(worker_id, function, gpu, mem_bytes)`; with ``batch_kv_bytes`` or ``burst_kv_bytes`` (off),
  `ResizeKV(worker_id, function, gpu, kv_bytes, delta_bytes, detail, cause)` (more KV for an offline batch
  or a burst, and its return).
- `pool`: `PoolTarget(gpu, backbone, shape, count)` for every (gpu, backbone, shape) planned or
  present (count 0 = none wanted there any more).
- `account`: gpu -> `MemoryAccount` (capacity, backbone/other/worker bytes, free now, free after).

Modules: account (memory account, with the driver's free memory as a second guard), charge (what a live
worker is charged: its own reported size once settled), backoff (failed starts), offload (victims under
pressure),
knapsack (generic greedy with precedence), exact (exact solver for small instances), planner (the
warm pool), decide (one round), synthetic (seeded random snapshots for tests and the benchmark), simulate
(the policy driven round by round over a trace's arrivals against a model of workers: bench/policy_replay.py).
"""

from lorafn.controller.policy.account import MemoryAccount
from lorafn.controller.policy.actions import (
    Bind,
    Park,
    Plan,
    PoolTarget,
    ResizeKV,
    Start,
    Stop,
    Unpark,
    Wait,
)
from lorafn.controller.policy.config import PolicyConfig
from lorafn.controller.policy.decide import decide
from lorafn.controller.policy.model import GPU, Backbone, Costs, Function, Snapshot, Worker

__all__ = [
    "GPU",
    "Backbone",
    "Bind",
    "Costs",
    "Function",
    "MemoryAccount",
    "Park",
    "Plan",
    "PolicyConfig",
    "PoolTarget",
    "ResizeKV",
    "Snapshot",
    "Start",
    "Stop",
    "Unpark",
    "Wait",
    "Worker",
    "decide",
]
