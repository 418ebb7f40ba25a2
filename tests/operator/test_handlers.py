"""The kopf handlers called directly, with kopf-shaped bodies and patches, an in-memory Kubernetes
(a dict of objects by path) and a real redis-server."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import kopf
import pytest
import redis

from lorafn.operator import events as operator_events
from lorafn.operator import handlers, registry
from lorafn.operator.builders import shape_label
from lorafn.operator.config import OperatorConfig
from lorafn.store import Keys, Store, control
from lorafn.store.registry import hash_api_key, lookup_api_key
from tests.unit.operator._peft import write_adapter, write_backbone

LOG = logging.getLogger("test")


class MemoryKube:
    """The five calls of lorafn.operator.kube.Kube over a dict: {collection path: {name: object}}."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, dict[str, Any]]] = {}
        self.writes = 0

    def _split(self, path: str) -> tuple[str, str]:
        collection, _, name = path.rpartition("/")
        return collection, name

    def put(self, collection: str, obj: dict[str, Any]) -> None:
        self.objects.setdefault(collection, {})[obj["metadata"]["name"]] = copy.deepcopy(obj)

    def get(self, path: str) -> dict[str, Any] | None:
        collection, name = self._split(path)
        return copy.deepcopy(self.objects.get(collection, {}).get(name))

    def list(self, path: str, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        items = list(self.objects.get(path, {}).values())
        return [
            copy.deepcopy(i)
            for i in items
            if all(i["metadata"].get("labels", {}).get(k) == v for k, v in (labels or {}).items())
        ]

    def ensure(self, path: str, body: dict[str, Any]) -> bool:
        if body["metadata"]["name"] in self.objects.get(path, {}):
            return False
        self.writes += 1
        self.put(path, body)
        return True

    def delete(self, path: str) -> bool:
        collection, name = self._split(path)
        self.writes += 1
        return self.objects.get(collection, {}).pop(name, None) is not None


@pytest.fixture
def world(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    events: list[tuple[str, str, str]] = []
    monkeypatch.setattr(operator_events, "post", lambda body, t, reason, msg: events.append((t, reason, msg)))
    memo = kopf.Memo()
    memo.config = OperatorConfig(
        namespace="lorafn-system",
        pvc_root=str(tmp_path / "pvc"),
        # the administrator's allow-lists (issue 15): file:// under the test's directory, these claims
        file_root=str(tmp_path),
        pvc_access={"adapters": ["team-a", "team-b"], "missing-claim": ["*"]},
    )
    memo.kube = MemoryKube()
    memo.registry = registry.Registry(redis_url)
    memo.redis = redis.Redis.from_url(redis_url, decode_responses=True)
    memo.kube.put(
        "/api/v1/nodes",
        {
            "metadata": {
                "name": "n1",
                "labels": {"nvidia.com/gpu.count": "1"},
                "annotations": {"lorafn.io/gpu-uuids": "GPU-00aa"},
            }
        },
    )
    (tmp_path / "pvc" / "adapters").mkdir(parents=True)
    write_adapter(tmp_path / "pvc" / "adapters" / "fr", rank=8)
    write_backbone(tmp_path / "models" / "tiny")
    memo.events = events
    memo.tmp = tmp_path
    return memo


def backbone_body(tmp_path: Path) -> dict[str, Any]:
    return {
        "apiVersion": "lorafn.io/v1alpha1",
        "kind": "Backbone",
        "metadata": {"name": "tiny", "uid": "u-bb", "generation": 1},
        "spec": {"model": {"uri": f"file://{tmp_path}/models/tiny"}, "warmPool": {"minStandby": 1}},
    }


def function_body(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "lorafn.io/v1alpha1",
        "kind": "LoRAFunction",
        "metadata": {"name": "fr", "namespace": "team-a", "uid": "u-fn", "generation": 2},
        "spec": {"backbone": "tiny", "adapter": {"uri": "pvc://adapters/fr"}, **spec},
    }


def run(handler: Any, body: dict[str, Any], memo: Any) -> kopf.Patch:
    patch = kopf.Patch()
    handler(body=kopf.Body(body), patch=patch, memo=memo, logger=LOG)
    return patch


def test_backbone_handler_creates_pods_and_patches_status(world: Any) -> None:
    body = backbone_body(world.tmp)
    patch = run(handlers.backbone_changed, body, world)
    pods = world.kube.list("/api/v1/namespaces/lorafn-system/pods")
    assert sorted(p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods) == [
        "backbone-server",
        "standby-worker",
    ]
    status = patch["status"]
    assert status["numGPUs"] == 1 and status["gpus"][0]["uuid"] == "GPU-00aa" and status["phase"] == "Loading"
    assert world.events[0][:2] == ("Normal", "Reconciled")
    # Idempotent: a second run (e.g. after a restart) writes nothing.
    writes = world.kube.writes
    body["status"] = status
    again = run(handlers.backbone_changed, body, world)
    assert world.kube.writes == writes
    assert "status" not in again  # same world, same status: nothing to write


def test_backbone_controller_can_raise_standby_within_bounds(world: Any) -> None:
    # Per GPU (`<node>/<uuid>`, as the inventory and the workers' --gpu name it).
    world.redis.hset("lorafn:bb:tiny:desired_standby", "n1/GPU-00aa|*", 99)
    run(handlers.backbone_changed, backbone_body(world.tmp), world)
    standby = world.kube.list(
        "/api/v1/namespaces/lorafn-system/pods", {"app.kubernetes.io/component": "standby-worker"}
    )
    assert len(standby) == 4  # maxStandby
    assert all(p["spec"]["restartPolicy"] == "OnFailure" for p in standby)
    assert {p["spec"]["containers"][0]["args"][6] for p in standby} == {"n1/GPU-00aa"}  # --gpu <id>


def _pod_names(world: Any, **labels: str) -> list[str]:
    pods = world.kube.list("/api/v1/namespaces/lorafn-system/pods", labels)
    return sorted(p["metadata"]["name"] for p in pods)


def test_stopped_pool_pods_are_not_counted_and_no_other_pod_goes(world: Any) -> None:
    """The controller stops standby-0 (retiring) and lowers the count 3 -> 2: standby-0 drains and ends
    by itself; the operator deletes neither it nor a busy sibling, then replaces nothing."""
    world.redis.hset("lorafn:bb:tiny:desired_standby", "n1/GPU-00aa|*", 3)
    body = backbone_body(world.tmp)
    run(handlers.backbone_changed, body, world)
    pool = _pod_names(world, **{"app.kubernetes.io/component": "standby-worker"})
    assert [n.rsplit("-", 1)[1] for n in pool] == ["0", "1", "2"]
    world.redis.zadd("lorafn:retiring", {pool[0]: world.registry.now_ms()})
    world.redis.hset("lorafn:bb:tiny:desired_standby", "n1/GPU-00aa|*", 2)
    run(handlers.backbone_changed, body, world)
    assert _pod_names(world, **{"app.kubernetes.io/component": "standby-worker"}) == pool
    # It ended (exit 0 after its drain: restartPolicy OnFailure leaves the pod Succeeded): removed, not
    # replaced, and its retiring mark goes with it.
    world.kube.objects["/api/v1/namespaces/lorafn-system/pods"][pool[0]]["status"] = {"phase": "Succeeded"}
    run(handlers.backbone_changed, body, world)
    assert _pod_names(world, **{"app.kubernetes.io/component": "standby-worker"}) == pool[1:]
    assert world.redis.zcard("lorafn:retiring") == 0
    # The controller asks one more: the lowest free name comes back as a fresh pod.
    world.redis.hset("lorafn:bb:tiny:desired_standby", "n1/GPU-00aa|*", 3)
    run(handlers.backbone_changed, body, world)
    assert _pod_names(world, **{"app.kubernetes.io/component": "standby-worker"}) == pool
    # A standby prepared for an adapter shape: its own pods (--shape), counted apart, within maxStandby (4).
    world.redis.hset("lorafn:bb:tiny:desired_standby", "n1/GPU-00aa|q_proj:8,v_proj:8", 5)
    run(handlers.backbone_changed, body, world)
    shaped = world.kube.list(
        "/api/v1/namespaces/lorafn-system/pods", {"lorafn.io/shape": shape_label("q_proj:8,v_proj:8")}
    )
    assert len(shaped) == 1
    args = shaped[0]["spec"]["containers"][0]["args"]
    assert args[args.index("--shape") + 1] == "q_proj:8,v_proj:8"
    assert shaped[0]["metadata"]["annotations"]["lorafn.io/shape"] == "q_proj:8,v_proj:8"
    world.redis.hdel("lorafn:bb:tiny:desired_standby", "n1/GPU-00aa|q_proj:8,v_proj:8")
    run(handlers.backbone_changed, body, world)
    assert _pod_names(world, **{"app.kubernetes.io/component": "standby-worker"}) == pool


def _kv_budgets(world: Any, **labels: str) -> dict[str, str]:
    """Pod name -> its --kv-budget-mib."""
    out = {}
    for pod in world.kube.list("/api/v1/namespaces/lorafn-system/pods", labels):
        args = pod["spec"]["containers"][0]["args"]
        out[pod["metadata"]["name"]] = args[args.index("--kv-budget-mib") + 1]
    return out


def test_standby_pods_get_the_kv_budget_the_controller_granted(world: Any) -> None:
    """A standby kept for a function with a KV budget above the default must be started with it (with the
    default it could never take that function, and each of its cold starts would be a fresh pod). New pods
    of a GPU and shape get the recorded budget; running pods are not replaced when it changes."""
    shape = "q_proj:8,v_proj:8"
    standby = {"app.kubernetes.io/component": "standby-worker", "lorafn.io/shape": shape_label(shape)}
    body = backbone_body(world.tmp)
    world.redis.hset("lorafn:bb:tiny:desired_standby", f"n1/GPU-00aa|{shape}", 1)
    world.redis.hset("lorafn:bb:tiny:desired_standby", "n1/GPU-00aa|*", 1)
    world.redis.hset("lorafn:bb:tiny:standby_kv", f"n1/GPU-00aa|{shape}", 2048)
    run(handlers.backbone_changed, body, world)
    first = _kv_budgets(world, **standby)
    assert list(first.values()) == ["2048"]
    # A larger function of the shape registers: the controller grants more and asks one more standby.
    world.redis.hset("lorafn:bb:tiny:standby_kv", f"n1/GPU-00aa|{shape}", 4096)
    world.redis.hset("lorafn:bb:tiny:desired_standby", f"n1/GPU-00aa|{shape}", 2)
    run(handlers.backbone_changed, body, world)
    both = _kv_budgets(world, **standby)
    assert len(both) == 2 and {n: both[n] for n in first} == first  # the running pod stays as it was
    assert sorted(both.values()) == ["2048", "4096"]  # the new one has the new budget
    # No budget recorded for a field (here the shape-agnostic one): the operator's default.
    agnostic = _kv_budgets(
        world, **{"app.kubernetes.io/component": "standby-worker", "lorafn.io/shape": "any"}
    )
    assert list(agnostic.values()) == [str(world.config.default_kv_mib)]
    # The backbone goes: its budgets go with its counts.
    handlers.backbone_deleted(body=kopf.Body(body), memo=world, logger=LOG)
    assert not world.redis.exists("lorafn:bb:tiny:standby_kv")
    assert not world.redis.exists("lorafn:bb:tiny:desired_standby")


def test_backbone_writes_the_gpu_inventory(world: Any) -> None:
    node = world.kube.get("/api/v1/nodes/n1")
    node["metadata"]["labels"]["nvidia.com/gpu.memory"] = "81559"
    world.kube.put("/api/v1/nodes", node)
    body = backbone_body(world.tmp)
    run(handlers.backbone_changed, body, world)
    store, keys = Store(world.registry.store.url), Keys()
    assert store.run(control.gpus(keys)) == {
        "n1/GPU-00aa": {"node": "n1", "total_bytes": 81559 * 2**20, "backbones": {}}
    }
    server = _pod_names(world, **{"app.kubernetes.io/component": "backbone-server"})[0]
    world.kube.objects["/api/v1/namespaces/lorafn-system/pods"][server]["status"] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    (world.tmp / "models" / "tiny" / "model.safetensors").write_bytes(b"\0" * 4096)
    run(handlers.backbone_changed, body, world)
    weights = 4096
    assert store.run(control.gpus(keys))["n1/GPU-00aa"]["backbones"] == {"tiny": weights}
    handlers.backbone_deleted(body=kopf.Body(body), memo=world, logger=LOG)
    assert store.run(control.gpus(keys)) == {}


def test_invalid_backbone_is_a_permanent_error_with_a_condition(world: Any) -> None:
    body = backbone_body(world.tmp)
    body["spec"]["warmPool"] = {"minStandby": 5, "maxStandby": 1}
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match="minStandby"):
        handlers.backbone_changed(body=kopf.Body(body), patch=patch, memo=world, logger=LOG)
    assert patch["status"]["conditions"][0]["reason"] == "InvalidSpec"
    assert world.kube.list("/api/v1/namespaces/lorafn-system/pods") == []


def _ready_backbone(world: Any) -> dict[str, Any]:
    body = backbone_body(world.tmp)
    patch = run(handlers.backbone_changed, body, world)
    body["status"] = dict(patch["status"])
    body["status"]["readyGPUs"] = 1
    body["status"]["gpus"][0]["ready"] = True
    world.kube.put("/apis/lorafn.io/v1alpha1/backbones", body)
    return body


def test_function_handler_registers_and_scales(world: Any) -> None:
    _ready_backbone(world)
    world.kube.put(
        "/api/v1/namespaces/team-a/secrets",
        {"metadata": {"name": "keys"}, "data": {"api-keys": "a2V5LW9uZQprZXktdHdvCg=="}},
    )  # key-one, key-two
    body = function_body(
        scaling={"minReplicas": 2, "maxReplicas": 3}, auth={"apiKeySecretRef": {"name": "keys"}}
    )
    status = run(handlers.function_changed, body, world)["status"]
    assert {c["type"]: c["reason"] for c in status["conditions"]} == {
        "BackboneReady": "BackboneReady",
        "AdapterReady": "AdapterValid",
        "Ready": "Invocable",
    }
    assert (status["replicas"], status["desiredReplicas"], status["observedGeneration"]) == (2, 2, 2)
    assert status["phase"] == "Scaling"
    assert status["adapter"]["rank"] == 8
    store, keys = Store(world.registry.store.url), Keys()
    salt = world.redis.get("lorafn:salt")
    for key in ("key-one", "key-two"):
        assert store.run(lookup_api_key(keys, hash_api_key(salt, key))) == "team-a/fr"
    record = world.redis.hgetall("lorafn:fn:team-a/fr")
    assert (
        record["model_dir"] == f"{world.tmp}/models/tiny" and record["adapter_dir"] == "/mnt/pvc/adapters/fr"
    )
    assert record["public"] == "0" and record["x_adapter_rank"] == "8"
    assert world.redis.hget("lorafn:bb:tiny", "model_dir") == f"{world.tmp}/models/tiny"
    workers = world.kube.list("/api/v1/namespaces/lorafn-system/pods", {"lorafn.io/function-name": "fr"})
    assert len(workers) == 2
    env = {e["name"]: e.get("value") for e in workers[0]["spec"]["containers"][0]["env"]}
    assert env["LORAFN_ADAPTER"] == "/mnt/pvc/adapters/fr"
    assert world.kube.get("/api/v1/namespaces/team-a/services/lfn-fr") is not None
    assert [r for t, r, _ in world.events if t == "Normal"][-1] in {"Invocable", "Scaled"}


def test_function_without_its_secret_is_not_registered(world: Any) -> None:
    _ready_backbone(world)
    status = run(handlers.function_changed, function_body(auth={"apiKeySecretRef": {"name": "nope"}}), world)[
        "status"
    ]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "SecretNotFound")
    assert not world.redis.sismember("lorafn:functions", "team-a/fr")


@pytest.mark.parametrize(
    ("spec", "cond_type", "reason"),
    [
        ({"adapter": {"uri": "https://example.com/fr"}}, "AdapterReady", "UnsupportedURIScheme"),
        ({"adapter": {"uri": "file://relative/fr"}}, "AdapterReady", "InvalidURI"),
        ({"scaling": {"minReplicas": 4, "maxReplicas": 1}}, "Ready", "InvalidSpec"),
        ({"colour": "blue"}, "Ready", "InvalidSpec"),
    ],
)
def test_invalid_function_spec_is_permanent(world: Any, spec: dict, cond_type: str, reason: str) -> None:
    _ready_backbone(world)
    world.redis.sadd("lorafn:functions", "team-a/fr")  # registered before the bad edit
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError):
        handlers.function_changed(body=kopf.Body(function_body(**spec)), patch=patch, memo=world, logger=LOG)
    conds = {c["type"]: (c["status"], c["reason"]) for c in patch["status"]["conditions"]}
    assert conds[cond_type] == ("False", reason)
    assert patch["status"]["phase"] == "Failed"
    assert not world.redis.sismember("lorafn:functions", "team-a/fr")
    assert world.events[-1][:2] == ("Warning", reason)


def test_adapter_problems_are_conditions_not_errors(world: Any) -> None:
    _ready_backbone(world)
    status = run(handlers.function_changed, function_body(adapter={"uri": "pvc://missing-claim/fr"}), world)[
        "status"
    ]
    assert next(c for c in status["conditions"] if c["type"] == "AdapterReady")["reason"] == "ClaimNotMounted"
    assert status["phase"] == "Pending"
    wrong = write_adapter(
        world.tmp / "pvc" / "adapters" / "big",
        backbone_config={
            "model_type": "llama",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
        },
    )
    status = run(handlers.function_changed, function_body(adapter={"uri": "pvc://adapters/big"}), world)[
        "status"
    ]
    adapter = next(c for c in status["conditions"] if c["type"] == "AdapterReady")
    assert adapter["reason"] == "ShapeMismatch" and "[8, 64]" not in adapter["message"]
    assert wrong.exists()


def test_timer_is_quiet_when_nothing_changed(world: Any) -> None:
    _ready_backbone(world)
    body = function_body()
    body["status"] = run(handlers.function_changed, body, world)["status"]
    patch = run(handlers.function_timer, body, world)
    assert "status" not in patch  # level-based re-check: same world, no write


def test_delete_handler_removes_redis_entries_and_workers(world: Any) -> None:
    _ready_backbone(world)
    body = function_body(scaling={"minReplicas": 1, "maxReplicas": 1})
    run(handlers.function_changed, body, world)
    world.redis.set("lorafn:fn:team-a/fr:desired_replicas", 1)
    assert world.redis.exists("lorafn:fn:team-a/fr")
    handlers.function_deleted(body=kopf.Body(body), memo=world, logger=LOG)
    assert world.redis.keys("lorafn:fn:team-a/fr:*") == []
    assert not world.redis.sismember("lorafn:functions", "team-a/fr")
    assert world.kube.list("/api/v1/namespaces/lorafn-system/pods", {"lorafn.io/function-name": "fr"}) == []
    assert world.kube.get("/api/v1/namespaces/team-a/services/lfn-fr") is None


def test_conflicts_become_temporary_errors(world: Any) -> None:
    from lorafn.operator import kube

    def conflict(*_: Any, **__: Any) -> None:
        raise kube.Conflict(409, "the object has been modified")

    world.kube.list = conflict
    with pytest.raises(kopf.TemporaryError) as info:
        run(handlers.backbone_changed, backbone_body(world.tmp), world)
    assert info.value.delay == 2


def test_a_key_opens_only_one_function(world: Any) -> None:
    _ready_backbone(world)
    for namespace in ("team-a", "team-b"):
        world.kube.put(
            f"/api/v1/namespaces/{namespace}/secrets",
            {"metadata": {"name": "keys"}, "stringData": {"api-keys": "shared-key"}},
        )
    first = function_body(auth={"apiKeySecretRef": {"name": "keys"}})
    second = function_body(auth={"apiKeySecretRef": {"name": "keys"}})
    second["metadata"] = {**second["metadata"], "namespace": "team-b", "uid": "u-fn-b"}
    run(handlers.function_changed, first, world)
    status = run(handlers.function_changed, second, world)["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "APIKeyInUse")
    assert world.redis.smembers("lorafn:functions") == {"team-a/fr"}


# -- which URIs tenants may name on the cluster (issue 15) ---------------------------------------------
def _adapter_condition(world: Any, **spec: Any) -> dict[str, Any]:
    status = run(handlers.function_changed, function_body(**spec), world)["status"]
    return next(c for c in status["conditions"] if c["type"] == "AdapterReady")


def test_file_uris_are_refused_by_default_with_a_clear_condition(world: Any) -> None:
    world.config = world.config.model_copy(update={"file_root": ""})
    adapter = write_adapter(world.tmp / "node" / "fr", rank=8)
    cond = _adapter_condition(world, adapter={"uri": f"file://{adapter}"})
    assert (cond["status"], cond["reason"]) == ("False", "FileURINotAllowed"), cond
    assert "operator.fileRoot" in cond["message"]
    assert not world.redis.sismember("lorafn:functions", "team-a/fr")
    assert not world.kube.list("/api/v1/namespaces/lorafn-system/pods", {"lorafn.io/function-name": "fr"})


def test_a_backbone_with_a_file_uri_outside_the_root_runs_no_pod(world: Any) -> None:
    world.config = world.config.model_copy(update={"file_root": str(world.tmp / "elsewhere")})
    status = run(handlers.backbone_changed, backbone_body(world.tmp), world)["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "FileURINotAllowed"), ready
    assert status["phase"] == "Failed"
    assert world.kube.list("/api/v1/namespaces/lorafn-system/pods") == []
    assert not world.redis.sismember("lorafn:backbones", "tiny")


def test_file_uris_under_the_root_but_linked_out_of_it_are_refused(world: Any) -> None:
    _ready_backbone(world)
    outside = write_adapter(world.tmp.parent / f"{world.tmp.name}-outside" / "fr", rank=8)
    link = world.tmp / "adapters-link"
    link.symlink_to(outside)
    cond = _adapter_condition(world, adapter={"uri": f"file://{link}"})
    assert (cond["status"], cond["reason"]) == ("False", "FileURINotAllowed"), cond
    assert f"really {outside}" in cond["message"]
    inside = write_adapter(world.tmp / "adapters-real" / "fr", rank=8)
    assert _adapter_condition(world, adapter={"uri": f"file://{inside}"})["status"] == "True"


def test_pvc_claims_only_for_the_namespaces_they_are_listed_for(world: Any) -> None:
    _ready_backbone(world)
    world.config = world.config.model_copy(update={"pvc_access": {"adapters": ["team-b"]}})
    cond = _adapter_condition(world)  # team-a names pvc://adapters/fr
    assert (cond["status"], cond["reason"]) == ("False", "ClaimNotAllowed"), cond
    assert "team-a" in cond["message"] and "operator.pvcAccess" in cond["message"]
    assert not world.redis.sismember("lorafn:functions", "team-a/fr")
    world.config = world.config.model_copy(update={"pvc_access": {"adapters": ["*"]}})
    assert _adapter_condition(world)["status"] == "True"
