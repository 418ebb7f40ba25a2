"""Small builders for policy tests: a snapshot in one call, sizes in GiB."""

from __future__ import annotations

from lorafn.controller.policy import GPU, Backbone, Costs, Function, Snapshot, Worker

GiB = 2**30
COSTS = Costs(fresh_start_s=20.0, bind_s=0.05, capture_s=4.0, default_standby_bytes=2 * GiB)


def gpu(id: str, total_gib: float = 80, backbones: dict[str, float] | None = None, node: str = "n0") -> GPU:
    held = {"llama": 13.0} if backbones is None else backbones
    return GPU(id, node, int(total_gib * GiB), {b: int(s * GiB) for b, s in held.items()})


def fn(name: str, shape: str = "r16", mem_gib: float = 2, backbone: str = "llama", **kw) -> Function:
    return Function(name, backbone, shape, int(mem_gib * GiB), **kw)


def standby(
    id: str, gpu: str, shape: str | None = "r16", mem_gib: float = 2, backbone: str = "llama", **kw
) -> Worker:
    return Worker(id, gpu, backbone, "standby", shape, None, int(mem_gib * GiB), **kw)


def bound(
    id: str, gpu: str, function: str, shape: str = "r16", mem_gib: float = 2, backbone: str = "llama", **kw
) -> Worker:
    return Worker(id, gpu, backbone, "bound", shape, function, int(mem_gib * GiB), **kw)


def snap(gpus, functions=(), workers=(), backbones=None, costs: Costs = COSTS) -> Snapshot:
    if backbones is None:
        backbones = (Backbone("llama", 13 * GiB, min_standby_per_gpu=0, max_standby_per_gpu=4),)
    return Snapshot(0.0, tuple(gpus), tuple(backbones), tuple(workers), tuple(functions), costs)


def next_rounds(snapshot: Snapshot, plan, config=None):
    """The two rounds after an offload, as the driver reports them: (1) the stopped workers still
    exiting (draining, their memory held, `room_for` = the function their Stop made room for), then
    (2) those processes gone. Returns the two plans."""
    import dataclasses

    from lorafn.controller.policy import Stop, decide

    stops = {a.worker_id: a for a in plan.of_type(Stop)}
    draining = tuple(
        dataclasses.replace(
            w, state="draining", running=0, preloaded=None, room_for=stops[w.id].room_for or None
        )
        if w.id in stops
        else w
        for w in snapshot.workers
    )
    first = decide(dataclasses.replace(snapshot, workers=draining), config)
    gone = tuple(w for w in snapshot.workers if w.id not in stops)
    return first, decide(dataclasses.replace(snapshot, workers=gone), config)
