"""The serverless core on Kubernetes: the real operator against KMock, a real `lorafn controller run`
process and a real redis-server. No kubelet runs, so no worker ever heartbeats: what is checked is the
chain demand -> controller -> desired count in Redis -> operator -> pod, the GPU inventory, the pool
pods staying put, and the controller's status reaching the LoRAFunction.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from lorafn.store import Keys, Store, control, streams
from lorafn.store.protocol import RequestBody
from tests.operator.conftest import NAMESPACE, Cluster, wait_for
from tests.operator.test_operator_kmock import BB_PATH, backbone, conditions, function, node
from tests.unit.operator._peft import write_adapter, write_backbone

pytest.importorskip("kmock", reason="KMock needs Python 3.11+")
pytestmark = pytest.mark.timeout(120)

FN_PATH = "/apis/lorafn.io/v1alpha1/namespaces/team-a/lorafunctions"
GPU_ID = "gpu-node-1/GPU-0000aaaa"
BIG_KV_MIB = 96


@pytest_asyncio.fixture
async def start_controller(redis_url: str, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    procs: list[asyncio.subprocess.Process] = []
    log = tmp_path / "controller.log"

    async def start() -> asyncio.subprocess.Process:
        env = dict(os.environ)
        env.update(
            LORAFN_REDIS_URL=redis_url,
            LORAFN_INTERVAL_S="0.2",
            LORAFN_DEVICE="cpu",
            LORAFN_LEASE_TTL_S="3",
            # the pool at its floor (minStandby): without demand seen, the burst policy's cold prior would
            # keep a second standby for the two never-invoked functions (tests/unit/controller covers that)
            LORAFN_COLD_PRIOR_RPS="0",
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "lorafn.cli", "controller", "run",
            env=env, stdout=log.open("a"), stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()


def admit(store: Store, keys: Keys, fn: str, rid: str) -> None:
    store.run(
        streams.admit(
            keys, fn, rid, RequestBody(prompt="hello"), deadline_ms=0, now_s=time.time(),
            rate_limit_rps=0.0, rate_limit_burst=1, heartbeat_ttl_ms=5000,
        )
    )  # fmt: skip


async def test_demand_leads_to_a_worker_pod_and_status_comes_back(
    cluster: Cluster, start_operator: Any, start_controller: Any, redis_url: str, tmp_path: Path
) -> None:
    store, keys = Store(redis_url), Keys()
    model = write_backbone(tmp_path / "models" / "tiny")
    (model / "model.safetensors").write_bytes(b"\0" * 8192)
    await cluster.create("/api/v1/nodes", node("gpu-node-1", ["GPU-0000aaaa"]))
    await cluster.create(BB_PATH, backbone("tiny", model, min_standby=1))
    adapter = write_adapter(tmp_path / "adapters" / "fr", rank=4)
    await cluster.create(FN_PATH, function("fr", f"file://{adapter}", scaling={"minReplicas": 0}))
    await cluster.create(
        FN_PATH,
        function("huge", f"file://{adapter}", scaling={"minReplicas": 0}, resources={"kvCacheMiB": 900_000}),
    )
    # a KV budget above the controller's default (32 MiB on CPU sizing): the pool's standbys must hold it
    await cluster.create(
        FN_PATH,
        function(
            "big", f"file://{adapter}", scaling={"minReplicas": 0}, resources={"kvCacheMiB": BIG_KV_MIB}
        ),
    )
    op = await start_operator()

    # The backbone server becomes Ready: its GPU enters the inventory with the backbone resident.
    server = await wait_for(
        lambda: cluster.pods(**{"app.kubernetes.io/component": "backbone-server"}), what="server pod"
    )
    await cluster.set_pod_ready(server[0]["metadata"]["name"])
    inventory = await wait_for(
        lambda: store.run(control.gpus(keys)).get(GPU_ID, {}).get("backbones"), what="inventory"
    )
    assert inventory == {"tiny": 8192}
    assert store.run(control.gpus(keys))[GPU_ID]["total_bytes"] == 81559 * 2**20
    standby = await wait_for(
        lambda: cluster.pods(**{"app.kubernetes.io/component": "standby-worker"}), what="standby pod"
    )
    assert len(standby) == 1 and standby[0]["spec"]["restartPolicy"] == "OnFailure"
    fr = await wait_for(
        lambda: _when(cluster.get(f"{FN_PATH}/fr"), lambda f: conditions(f).get("Ready", ("",))[0] == "True"),
        what="fr Ready",
    )
    assert fr["status"]["phase"] == "Idle"
    await wait_for(
        lambda: _when(
            cluster.get(f"{FN_PATH}/big"), lambda f: conditions(f).get("Ready", ("",))[0] == "True"
        ),
        what="big Ready",
    )
    # The controller starts once the functions are registered (each is registered when its reconcile sees
    # the backbone Ready): its first pool plan knows every function the standby is kept for.
    await start_controller()
    await wait_for(
        lambda: store.run(control.lease_holder(keys)), what="the controller holds the lease"
    )  # fmt: skip
    assert await cluster.pods(**{"lorafn.io/function-name": "fr"}) == []

    # No demand yet: the pool settles — the controller prepares the minStandby pod for the adapter shape of
    # the backbone's functions, so the operator's first, shape-agnostic pod is replaced once — and then the
    # standby stays the same pod while the controller runs rounds (0.2 s) and the operator re-checks (0.5 s):
    # the controller counts it as starting (no kubelet here), asks nothing more.
    settled = await wait_for(
        lambda: _when(
            cluster.pods(**{"app.kubernetes.io/component": "standby-worker"}),
            lambda pods: len(pods) == 1 and pods[0]["metadata"]["name"] != standby[0]["metadata"]["name"],
        ),
        what="the standby prepared for the functions' shape",
    )
    # ... started with the KV budget the controller granted it (recorded beside its count), big enough for
    # the function of that shape with the largest budget: with the default it could never take `big`.
    args = settled[0]["spec"]["containers"][0]["args"]
    shape = args[args.index("--shape") + 1]
    recorded = store.run(control.standby_kv(keys, "tiny"))[(GPU_ID, shape)]
    assert int(args[args.index("--kv-budget-mib") + 1]) == recorded >= BIG_KV_MIB
    await asyncio.sleep(3)
    again = await cluster.pods(**{"app.kubernetes.io/component": "standby-worker"})
    assert [p["metadata"]["name"] for p in again] == [settled[0]["metadata"]["name"]]
    assert creations(cluster, settled[0]["metadata"]["name"]) == 1
    assert creations(cluster, standby[0]["metadata"]["name"]) == 1  # replaced once, not churned

    # Demand for the minReplicas-0 function: no standby is live (no kubelet here). The controller first waits
    # for the standby it sees warming up, at most until a fresh start would have been ready (10 s on CPU
    # sizing), then starts a fresh worker; the operator creates its pod on the backbone's GPU.
    admit(store, keys, "team-a/fr", "r1")
    workers = await wait_for(
        lambda: cluster.pods(**{"lorafn.io/function-name": "fr"}), timeout=40.0, what="worker pod"
    )
    assert len(workers) == 1
    args = workers[0]["spec"]["containers"][0]["args"]
    assert args[args.index("--function") + 1] == "team-a/fr" and args[args.index("--gpu") + 1] == GPU_ID
    assert store.run(control.desired_replicas(keys, ["team-a/fr"]))["team-a/fr"] == 1

    # The worker's container crashes before serving (the kubelet's view, as the pod's status shows it): the
    # operator reports it, the controller counts a failed start of the function (its backoff) and says why.
    crashed = {
        "phase": "Running",
        "containerStatuses": [
            {
                "name": "worker", "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {
                    "terminated": {"exitCode": 3, "reason": "Error", "finishedAt": "2026-11-23T14:00:00Z"}
                },
            }
        ],
    }  # fmt: skip
    await cluster.patch(
        f"/api/v1/namespaces/{NAMESPACE}/pods/{workers[0]['metadata']['name']}", {"status": crashed}
    )
    failed = await wait_for(
        lambda: _when(
            asyncio.sleep(0, store.run(control.statuses(keys, ["team-a/fr"]))["team-a/fr"]),
            lambda st: st.get("start_failures") == "1",
        ),
        what="the crash counted as a failed start",
    )
    assert "exited with code 3" in failed["last_failure"], failed
    await asyncio.sleep(1.5)  # reported at every reconcile, counted once
    assert store.run(control.statuses(keys, ["team-a/fr"]))["team-a/fr"]["start_failures"] == "1"

    # A function that fits no GPU waits, and its status says why.
    admit(store, keys, "team-a/huge", "r2")
    huge = await wait_for(
        lambda: _when(
            cluster.get(f"{FN_PATH}/huge"),
            lambda f: conditions(f).get("Ready", ("",))[1] == "WaitingForCapacity",
        ),
        what="huge waits",
    )
    message = next(c["message"] for c in huge["status"]["conditions"] if c["type"] == "Ready")
    assert "GiB" in message or "fit" in message, message
    assert await cluster.pods(**{"lorafn.io/function-name": "huge"}) == []

    # A worker reports a bind (as the runtime does on the lifecycle stream): the controller records the
    # cold start, and the operator shows it.
    store.run(
        control.post_event(keys, control.BOUND, function="team-a/fr", worker="w-1", ms=137, path="standby")
    )
    fr = await wait_for(
        lambda: _when(cluster.get(f"{FN_PATH}/fr"), lambda f: f["status"].get("lastColdStartMs") == 137),
        what="lastColdStartMs",
    )
    assert op.running, op.output()[-3000:]
    store.close()


def creations(cluster: Cluster, pod_name: str) -> int:
    """How many times a pod of that name was created (KMock keeps every request): a POST while the pod
    exists is a conflict, not a creation (two reconciles of the operator, e.g. its timer and a change
    handler, may both find the pod missing and both post it; the second gets 409)."""
    import kmock

    path = f"/api/v1/namespaces/{NAMESPACE}/pods"
    count, exists = 0, False
    for req in cluster.km:
        if (
            req.method == kmock.method.POST
            and req.url.path == path
            and isinstance(req.data, dict)
            and req.data.get("metadata", {}).get("name") == pod_name
        ):
            count, exists = count + (not exists), True
        elif req.method == kmock.method.DELETE and req.url.path == f"{path}/{pod_name}":
            exists = False
    return count


async def _when(awaitable: Any, check: Any) -> Any:
    value = await awaitable
    return value if value and check(value) else None
