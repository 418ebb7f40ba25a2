"""The real operator process (`lorafn operator run`) against KMock's Kubernetes API and a real Redis.

KMock (kopf's mock API server) keeps objects in memory and serves list/watch/get/create/patch/delete;
it runs no kubelet, scheduler or garbage collector, so the tests play the kubelet (pod readiness) and
check that the operator itself deletes what it made.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import redis

from lorafn.store import Keys, Store
from lorafn.store.registry import get_function, hash_api_key, lookup_api_key
from tests.operator.conftest import NAMESPACE, Cluster, wait_for
from tests.unit.operator._peft import write_adapter, write_backbone

pytest.importorskip("kmock", reason="KMock needs Python 3.11+")
pytestmark = pytest.mark.timeout(180)

BB_PATH = "/apis/lorafn.io/v1alpha1/backbones"
FN_PATH = "/apis/lorafn.io/v1alpha1/namespaces/team-a/lorafunctions"
API_KEY = "sk-team-a-0001"


def node(name: str, uuids: list[str], count: int | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "nvidia.com/gpu.count": str(len(uuids) if count is None else count),
                "nvidia.com/gpu.memory": "81559",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            },
            "annotations": {"lorafn.io/gpu-uuids": ",".join(uuids)},
        },
    }


def backbone(name: str, model_dir: Path, min_standby: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "lorafn.io/v1alpha1",
        "kind": "Backbone",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": f"file://{model_dir}"},
            "warmPool": {"minStandby": min_standby, "maxStandby": 4},
        },
    }


def function(name: str, adapter_uri: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "lorafn.io/v1alpha1",
        "kind": "LoRAFunction",
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": {"backbone": "tiny", "adapter": {"uri": adapter_uri}, **spec},
    }


def conditions(obj: dict[str, Any] | None) -> dict[str, tuple[str, str]]:
    return {
        c["type"]: (c["status"], c["reason"]) for c in ((obj or {}).get("status") or {}).get("conditions", [])
    }


async def ready_backbone(cluster: Cluster, tmp_path: Path) -> None:
    await cluster.create("/api/v1/nodes", node("gpu-node-1", ["GPU-0000aaaa"]))
    await cluster.create(BB_PATH, backbone("tiny", write_backbone(tmp_path / "models" / "tiny")))


async def test_backbone_and_function_lifecycle(
    cluster: Cluster, start_operator: Any, redis_url: str, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    await ready_backbone(cluster, tmp_path)
    op = await start_operator()

    # Backbone -> one server and minStandby standby workers on the one selected GPU.
    pods = await wait_for(lambda: cluster.pods(**{"lorafn.io/backbone": "tiny"}), what="backbone pods")
    pods = await wait_for(
        lambda: _when(cluster.pods(**{"lorafn.io/backbone": "tiny"}), lambda p: len(p) == 2), what="2 pods"
    )
    components = sorted(p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods)
    assert components == ["backbone-server", "standby-worker"]
    server = next(p for p in pods if p["metadata"]["name"].endswith("-server"))
    env = {e["name"]: e.get("value") for e in server["spec"]["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-0000aaaa"
    bb = await wait_for(
        lambda: _when(cluster.get(f"{BB_PATH}/tiny"), lambda b: (b.get("status") or {}).get("gpus"))
    )
    assert bb["status"]["phase"] == "Loading" and bb["status"]["gpus"][0]["memoryMiB"] == 81559

    await cluster.set_pod_ready(server["metadata"]["name"])
    bb = await wait_for(
        lambda: _when(cluster.get(f"{BB_PATH}/tiny"), lambda b: b["status"].get("readyGPUs") == 1),
        what="backbone ready",
    )
    assert conditions(bb)["Ready"] == ("True", "ServersReady")

    # LoRAFunction -> checks, Redis registration, min replicas, Service, status.
    adapter = write_adapter(tmp_path / "adapters" / "french", rank=4)
    await cluster.create(
        "/api/v1/namespaces/team-a/secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "french-keys", "namespace": "team-a"},
            "stringData": {"api-keys": f"{API_KEY}\n# a comment\n"},
        },
    )
    await cluster.create(
        FN_PATH,
        function(
            "french",
            f"file://{adapter}",
            scaling={"minReplicas": 1, "maxReplicas": 3},
            auth={"apiKeySecretRef": {"name": "french-keys"}},
        ),
    )
    fn = await wait_for(
        lambda: _when(
            cluster.get(f"{FN_PATH}/french"), lambda f: conditions(f).get("Ready", ("",))[0] == "True"
        ),
        what="function Ready",
    )
    assert conditions(fn) == {
        "BackboneReady": ("True", "BackboneReady"),
        "AdapterReady": ("True", "AdapterValid"),
        "Ready": ("True", "Invocable"),
    }
    assert fn["status"]["endpoint"] == (
        "http://lorafn-gateway.lorafn-system.svc.cluster.local/v1/functions/team-a/french:invoke"
    )
    assert fn["status"]["adapter"]["rank"] == 4 and fn["status"]["observedGeneration"] == 1
    assert r.sismember("lorafn:functions", "team-a/french")
    # What the gateway reads (lorafn.store): the key opens this function and no other; no plaintext.
    keys = Keys()
    salt = r.get("lorafn:salt")
    assert Store(redis_url).run(lookup_api_key(keys, hash_api_key(salt, API_KEY))) == "team-a/french"
    assert API_KEY not in json.dumps(
        {k: r.type(k) for k in r.keys("*")} | {"v": r.hgetall("lorafn:fn:team-a/french")}
    )
    record = Store(redis_url).run(get_function(keys, "team-a/french"))
    assert record.spec["scaling"]["maxReplicas"] == 3 and record.extra["adapter_dtype"] == "float32"
    assert not record.public and record.adapter_dir == str(adapter)
    workers = await wait_for(
        lambda: cluster.pods(**{"lorafn.io/function-name": "french"}), what="min replica"
    )
    assert len(workers) == 1
    svc = await wait_for(lambda: cluster.get("/api/v1/namespaces/team-a/services/lfn-french"), what="service")
    assert svc["spec"]["type"] == "ExternalName"

    # The controller asks for more than maxReplicas: clamped to 3, names deterministic.
    r.set("lorafn:fn:team-a/french:desired_replicas", 7)
    workers = await wait_for(
        lambda: _when(cluster.pods(**{"lorafn.io/function-name": "french"}), lambda w: len(w) == 3),
        what="3 workers",
    )
    names = sorted(w["metadata"]["name"] for w in workers)
    assert [n.rsplit("-", 1)[1] for n in names] == ["0", "1", "2"]
    for name in names:
        await cluster.set_pod_ready(name)
    r.hset("lorafn:fn:team-a/french:status", "last_cold_start_ms", 42)  # the controller writes it
    fn = await wait_for(
        lambda: _when(cluster.get(f"{FN_PATH}/french"), lambda f: f["status"].get("phase") == "Ready"),
        what="phase Ready",
    )
    assert (fn["status"]["replicas"], fn["status"]["readyReplicas"], fn["status"]["desiredReplicas"]) == (
        3,
        3,
        3,
    )
    assert fn["status"]["lastColdStartMs"] == 42
    events = [e for e in cluster.posted_events() if e["involvedObject"].get("name") == "french"]
    assert {"AdapterValid", "Invocable", "Scaled"} <= {e["reason"] for e in events}

    # Scale down: the controller asks 0; minReplicas 1 holds one worker, replica 0.
    r.set("lorafn:fn:team-a/french:desired_replicas", 0)
    workers = await wait_for(
        lambda: _when(cluster.pods(**{"lorafn.io/function-name": "french"}), lambda w: len(w) == 1),
        what="scale down",
    )
    assert workers[0]["metadata"]["name"] == names[0]
    await asyncio.sleep(1.5)  # let the status settle

    # An operator restart changes nothing: no object is written, nothing created or deleted.
    before = await _snapshot(cluster)
    await op.stop()
    op = await start_operator()
    await asyncio.sleep(4)  # resume handlers + several timer ticks
    after = await _snapshot(cluster)
    assert after == before
    assert op.running, op.output()[-3000:]

    # Deleting the function: the finalizer removes its Redis entries, workers and Service.
    await cluster.delete(f"{FN_PATH}/french")
    await wait_for(lambda: _not(cluster.get(f"{FN_PATH}/french")), what="function gone")
    assert await cluster.pods(**{"lorafn.io/function-name": "french"}) == []
    assert await cluster.get("/api/v1/namespaces/team-a/services/lfn-french") is None
    assert not r.sismember("lorafn:functions", "team-a/french")
    assert not r.exists("lorafn:fn:team-a/french") and not r.exists("lorafn:fn:team-a/french:keys")
    assert not r.exists("lorafn:fn:team-a/french:desired_replicas")
    assert r.hlen("lorafn:apikeys") == 0

    # Deleting the backbone removes its pods.
    await cluster.delete(f"{BB_PATH}/tiny")
    await wait_for(lambda: _not(cluster.get(f"{BB_PATH}/tiny")), what="backbone gone")
    await wait_for(lambda: _when(cluster.pods(), lambda p: p == [], empty_ok=True), what="pods gone")
    assert op.running


async def test_invalid_specs_and_missing_adapters_get_conditions(
    cluster: Cluster, start_operator: Any, redis_url: str, tmp_path: Path
) -> None:
    await ready_backbone(cluster, tmp_path)
    op = await start_operator()
    server = await wait_for(
        lambda: _when(
            cluster.pods(**{"app.kubernetes.io/component": "backbone-server"}), lambda p: len(p) == 1
        ),
        what="server pod",
    )
    await cluster.set_pod_ready(server[0]["metadata"]["name"])

    await cluster.create(FN_PATH, function("from-s3", "s3://bucket/french"))
    missing = tmp_path / "adapters" / "later"
    await cluster.create(FN_PATH, function("later", f"file://{missing}"))
    # minReplicas > maxReplicas: the CRD's CEL rule refuses it on a real API server; KMock has none,
    # so the operator's own validation is what answers here.
    await cluster.create(
        FN_PATH, function("greedy", f"file://{missing}", scaling={"minReplicas": 5, "maxReplicas": 2})
    )
    await cluster.create(FN_PATH, function("orphan", f"file://{missing}", backbone="nope"))

    s3 = await wait_for(
        lambda: _when(cluster.get(f"{FN_PATH}/from-s3"), lambda f: (f.get("status") or {}).get("phase")),
        what="s3 status",
    )
    assert s3["status"]["phase"] == "Failed"
    assert conditions(s3)["AdapterReady"] == ("False", "UnsupportedURIScheme")
    greedy = await wait_for(
        lambda: _when(cluster.get(f"{FN_PATH}/greedy"), lambda f: (f.get("status") or {}).get("phase")),
        what="greedy status",
    )
    assert conditions(greedy)["Ready"] == ("False", "InvalidSpec")
    assert (
        "minReplicas (5) must be <= scaling.maxReplicas (2)" in greedy["status"]["conditions"][-1]["message"]
    )
    later = await wait_for(
        lambda: _when(cluster.get(f"{FN_PATH}/later"), lambda f: (f.get("status") or {}).get("phase")),
        what="later status",
    )
    assert later["status"]["phase"] == "Pending"
    assert conditions(later)["AdapterReady"] == ("False", "AdapterNotFound")
    orphan = await wait_for(
        lambda: _when(cluster.get(f"{FN_PATH}/orphan"), lambda f: (f.get("status") or {}).get("phase")),
        what="orphan status",
    )
    assert conditions(orphan)["BackboneReady"] == ("False", "BackboneNotFound")

    # No crash loop and no retry storm: the invalid objects are not written again.
    written = {
        n: cluster.versions("lorafn.io/v1alpha1/lorafunctions", "team-a", n) for n in ("from-s3", "greedy")
    }
    await asyncio.sleep(3)
    assert {n: cluster.versions("lorafn.io/v1alpha1/lorafunctions", "team-a", n) for n in written} == written
    assert op.running, op.output()[-3000:]
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    assert r.smembers("lorafn:functions") == set()

    # Level-based: the adapter appears later and the function becomes Ready without any edit.
    write_adapter(missing)
    later = await wait_for(
        lambda: _when(
            cluster.get(f"{FN_PATH}/later"), lambda f: conditions(f).get("Ready", ("",))[0] == "True"
        ),
        what="later ready",
    )
    assert conditions(later)["AdapterReady"] == ("True", "AdapterValid")
    assert later["status"]["phase"] == "Idle"  # minReplicas 0: scaled to zero, still invocable
    assert r.smembers("lorafn:functions") == {"team-a/later"}

    # Settled: the timers keep checking, and write nothing while nothing changes.
    await asyncio.sleep(1.5)
    quiet = (
        cluster.versions("lorafn.io/v1alpha1/lorafunctions", "team-a", "later"),
        cluster.versions("lorafn.io/v1alpha1/backbones", None, "tiny"),
    )
    await asyncio.sleep(2.5)
    assert (
        cluster.versions("lorafn.io/v1alpha1/lorafunctions", "team-a", "later"),
        cluster.versions("lorafn.io/v1alpha1/backbones", None, "tiny"),
    ) == quiet

    # An edit of the spec (kubectl edit): two warm replicas wanted now.
    await cluster.patch(f"{FN_PATH}/later", {"spec": {"scaling": {"minReplicas": 2, "maxReplicas": 2}}})
    workers = await wait_for(
        lambda: _when(cluster.pods(**{"lorafn.io/function-name": "later"}), lambda w: len(w) == 2),
        what="2 workers after the edit",
    )
    assert sorted(w["metadata"]["labels"]["lorafn.io/replica"] for w in workers) == ["0", "1"]
    record = json.loads(r.hget("lorafn:fn:team-a/later", "spec"))
    assert record["scaling"]["minReplicas"] == 2
    assert op.running


async def test_dra_mode_shares_one_claim_per_gpu(
    cluster: Cluster, start_operator: Any, tmp_path: Path
) -> None:
    import kmock

    cluster.km.resources["resource.k8s.io/v1/resourceclaims"] = kmock.ResourceInfo(
        kind="ResourceClaim", namespaced=True, verbs={"get", "list", "create", "delete"}
    )
    await cluster.create("/api/v1/nodes", node("gpu-node-1", [], count=1))  # DRA needs no UUIDs
    await cluster.create(
        BB_PATH, backbone("tiny", write_backbone(tmp_path / "models" / "tiny"), min_standby=2)
    )
    await start_operator(LORAFN_OPERATOR_GPU_SHARING="dra")
    claims = await wait_for(
        lambda: cluster.items(f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"), what="claim"
    )
    assert len(claims) == 1
    pods = await wait_for(
        lambda: _when(cluster.pods(**{"lorafn.io/backbone": "tiny"}), lambda p: len(p) == 3)
    )
    for pod in pods:
        assert pod["spec"]["resourceClaims"] == [
            {"name": "gpu", "resourceClaimName": claims[0]["metadata"]["name"]}
        ]


async def _snapshot(cluster: Cluster) -> dict[str, Any]:
    pods = {p["metadata"]["name"]: p for p in await cluster.pods()}
    return {
        "pods": pods,
        "pod_versions": {n: cluster.versions("v1/pods", NAMESPACE, n) for n in pods},
        "function": (await cluster.get(f"{FN_PATH}/french"))["status"],
        "backbone": (await cluster.get(f"{BB_PATH}/tiny"))["status"],
        "service": await cluster.get("/api/v1/namespaces/team-a/services/lfn-french"),
    }


async def _when(awaitable: Any, check: Any, empty_ok: bool = False) -> Any:
    value = await awaitable
    ok = check(value)
    if empty_ok and ok:
        return True
    return value if ok else None


async def _not(awaitable: Any) -> bool:
    return (await awaitable) is None
