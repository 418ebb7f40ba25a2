from lorafn.operator import reducers
from lorafn.operator.builders import GPUSlot, SlotProblem

NOW, LATER = "2026-11-21T10:00:00Z", "2026-11-21T10:05:00Z"


def pod(
    name: str, *, ready: bool = False, phase: str = "Running", deleting: bool = False, **labels: str
) -> dict:
    meta: dict = {"name": name, "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = NOW
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {"metadata": meta, "status": {"phase": phase, "conditions": conditions}}


def test_condition_keeps_transition_time_while_status_holds() -> None:
    first = reducers.condition("Ready", "False", "A", "m", generation=1, now=NOW)
    same = reducers.condition("Ready", "False", "B", "m2", generation=2, now=LATER, previous=[first])
    flipped = reducers.condition("Ready", "True", "C", "m3", generation=2, now=LATER, previous=[same])
    assert same["lastTransitionTime"] == NOW and same["reason"] == "B"
    assert flipped["lastTransitionTime"] == LATER


def test_clamp() -> None:
    assert reducers.clamp_replicas(None, 1, 4) == 1
    assert reducers.clamp_replicas(9, 0, 4) == 4
    assert reducers.clamp_replicas(0, 2, 4) == 2
    assert reducers.clamp_replicas(3, 0, 4) == 3


def test_plan_pods() -> None:
    existing = [
        pod("w-0"),
        pod("w-1", phase="Succeeded"),
        pod("w-2"),
        pod("w-3", deleting=True),
    ]
    plan = reducers.plan_pods(["w-0", "w-1", "w-3", "w-4"], existing)
    assert plan.create == ["w-4"]  # w-3 is being deleted: created again once gone
    assert plan.delete == ["w-1", "w-2"]  # finished, unwanted
    assert reducers.plan_pods(["w-0"], [pod("w-0")]) == reducers.PodPlan()


def test_backbone_status() -> None:
    slots = [GPUSlot("n", 0, uuid="GPU-a", memory_mib=80), GPUSlot("n", 1, uuid="GPU-b")]
    s0, s1 = slots[0].slot_id, slots[1].slot_id
    pods = [
        pod("srv0", ready=True, **{"lorafn.io/slot": s0, "app.kubernetes.io/component": "backbone-server"}),
        pod("sb0", ready=True, **{"lorafn.io/slot": s0, "app.kubernetes.io/component": "standby-worker"}),
        pod("srv1", **{"lorafn.io/slot": s1, "app.kubernetes.io/component": "backbone-server"}),
    ]
    status = reducers.backbone_status(
        slots=slots,
        problems=[],
        pods=pods,
        server_names={s0: "srv0", s1: "srv1"},
        claim_names={},
        generation=2,
        now=NOW,
        previous=None,
    )
    assert (status["phase"], status["numGPUs"], status["readyGPUs"]) == ("Loading", 2, 1)
    assert status["gpus"][0] == {
        "slot": s0,
        "node": "n",
        "index": 0,
        "server": "srv0",
        "ready": True,
        "standbyWorkers": 1,
        "readyStandbyWorkers": 1,
        "uuid": "GPU-a",
        "memoryMiB": 80,
    }
    assert {c["type"]: c["status"] for c in status["conditions"]} == {"GPUsSelected": "True", "Ready": "True"}
    none = reducers.backbone_status(
        slots=[],
        problems=[SlotProblem("NoMatchingNodes", "no node")],
        pods=[],
        server_names={},
        claim_names={},
        generation=1,
        now=NOW,
        previous=None,
    )
    assert none["phase"] == "Failed"
    assert none["conditions"][0]["reason"] == "NoMatchingNodes"


def test_backbone_ready_view() -> None:
    assert reducers.backbone_ready(None)[:2] == (False, "BackboneNotFound")
    assert reducers.backbone_ready({"status": {"readyGPUs": 2}})[0] is True
    assert reducers.backbone_ready({"status": {}})[:2] == (False, "BackboneNotReady")


def _fn(**kw):
    args = dict(
        generation=4,
        now=NOW,
        previous=None,
        endpoint="http://gw/v1/functions/a/b:invoke",
        backbone=(True, "BackboneReady", "ok"),
        adapter=(True, "AdapterValid", "ok"),
        adapter_info={"rank": 4},
        registered=True,
        desired=0,
        pods=[],
        last_cold_start_ms=None,
    )
    args.update(kw)
    return reducers.function_status(**args)


def test_function_phases() -> None:
    idle = _fn()
    assert (idle["phase"], idle["replicas"], idle["observedGeneration"]) == ("Idle", 0, 4)
    assert {c["type"]: c["status"] for c in idle["conditions"]} == {
        "BackboneReady": "True",
        "AdapterReady": "True",
        "Ready": "True",
    }
    assert _fn(desired=1)["phase"] == "Scaling"
    assert _fn(desired=1, pods=[pod("w", ready=True)], last_cold_start_ms=42)["phase"] == "Ready"
    assert _fn(desired=1, pods=[pod("w", ready=True)], last_cold_start_ms=42)["lastColdStartMs"] == 42
    missing = _fn(adapter=(False, "AdapterNotFound", "no dir"), registered=False)
    assert missing["phase"] == "Pending"
    ready = next(c for c in missing["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "AdapterNotFound")
    nokeys = _fn(registered=False, registration=(False, "SecretNotFound", "no secret"))
    assert next(c for c in nokeys["conditions"] if c["type"] == "Ready")["reason"] == "SecretNotFound"


def test_failed_status_for_invalid_specs() -> None:
    status = reducers.failed_function_status(
        generation=2,
        now=NOW,
        previous=None,
        condition_type="AdapterReady",
        reason="UnsupportedURIScheme",
        message="scheme 's3'",
    )
    assert status["phase"] == "Failed"
    assert [(c["type"], c["reason"]) for c in status["conditions"]] == [
        ("AdapterReady", "UnsupportedURIScheme"),
        ("Ready", "UnsupportedURIScheme"),
    ]


def test_status_patch_converges() -> None:
    old = {"phase": "Ready", "adapter": {"rank": 4}, "lastColdStartMs": 12}
    new = {"phase": "Pending", "lastColdStartMs": None, "replicas": 0}
    patch = reducers.status_patch(old, new)
    assert patch == {"phase": "Pending", "replicas": 0, "adapter": None, "lastColdStartMs": None}
    stored = {k: v for k, v in {**old, **patch}.items() if v is not None}
    assert reducers.status_patch(stored, new) == {}
