"""Seeded random snapshots of a plausible cluster, for the policy's tests and bench/controller.py.

Not a model of any real trace: sizes are in the range DESIGN §6 measured (a 7B bf16 backbone is
~13 GiB, a worker's reservation 0.5-4 GiB), arrival rates are heavy-tailed (most functions cold,
a few hot), and some functions already have bound workers, some GPUs standby workers.
"""

from __future__ import annotations

import random

from lorafn.controller.policy.model import GPU, Backbone, Costs, Function, Snapshot, Worker

GiB = 2**30


def random_snapshot(
    seed: int,
    num_functions: int,
    num_gpus: int,
    num_backbones: int = 2,
    num_shapes: int = 3,
    gpu_bytes: int = 80 * GiB,
    backbones_per_gpu: int = 1,
    max_standby_per_gpu: int = 4,
    bound_fraction: float = 0.3,
    queued_fraction: float = 0.05,
) -> Snapshot:
    rng = random.Random(seed)
    backbones = []
    sizes = {}
    for b in range(num_backbones):
        name = f"bb{b}"
        sizes[name] = rng.choice((3, 7, 13, 16)) * GiB
        backbones.append(
            Backbone(
                name,
                sizes[name],
                min_standby_per_gpu=rng.choice((0, 0, 1)),
                max_standby_per_gpu=max_standby_per_gpu,
            )
        )
    gpus = []
    for g in range(num_gpus):
        held = {f"bb{(g + j) % num_backbones}" for j in range(min(backbones_per_gpu, num_backbones))}
        resident = {name: sizes[name] for name in sorted(held)}
        gpus.append(GPU(f"gpu{g}", f"node{g // 8}", gpu_bytes, resident, other_bytes=rng.randrange(0, GiB)))
    shapes = [f"all-linear:r{8 * (s + 1)}" for s in range(num_shapes)]
    functions = []
    for i in range(num_functions):
        rate = rng.paretovariate(1.2) * 0.01 if rng.random() < 0.7 else 0.0
        queued = rng.randrange(1, 12) if rng.random() < queued_fraction else 0
        functions.append(
            Function(
                name=f"ns/f{i}",
                backbone=f"bb{rng.randrange(num_backbones)}",
                shape=rng.choice(shapes),
                mem_bytes=rng.choice((1, 2, 3, 4)) * GiB // 2,
                min_replicas=1 if rng.random() < 0.05 else 0,
                max_replicas=rng.choice((1, 2, 4)),
                keep_alive_s=60.0,
                arrival_rate=round(rate, 4),
                queued=queued,
                oldest_wait_s=rng.random() * 5 if queued else 0.0,
            )
        )
    free = {g.id: int(gpu_bytes * 0.9) - sum(g.backbones.values()) - g.other_bytes for g in gpus}
    holders = {b.name: [g.id for g in gpus if b.name in g.backbones] for b in backbones}
    workers = []
    for f in functions:
        if rng.random() >= bound_fraction or not holders[f.backbone]:
            continue
        gpu = rng.choice(holders[f.backbone])
        if free[gpu] < f.mem_bytes:
            continue
        free[gpu] -= f.mem_bytes
        running = rng.randrange(0, 3) if rng.random() < 0.5 else 0
        workers.append(
            Worker(
                f"w{len(workers)}",
                gpu,
                f.backbone,
                "bound",
                f.shape,
                f.name,
                f.mem_bytes,
                idle_s=0.0 if running else rng.random() * 90,
                running=running,
                age_s=100.0,
            )
        )
    for g in gpus:
        for name in g.backbones:
            for _ in range(rng.randrange(0, 3)):
                size = 2 * GiB
                if free[g.id] < size:
                    break
                free[g.id] -= size
                workers.append(
                    Worker(
                        f"w{len(workers)}",
                        g.id,
                        name,
                        "standby",
                        rng.choice([*shapes, None]),
                        None,
                        size,
                        age_s=50.0,
                    )
                )
    # Standbys of larger ranks hold larger LoRA buffers and graph pools: sizes differ by shape.
    by_shape = {shape: rng.choice((2, 3, 4, 5, 6, 8)) * GiB // 2 for shape in shapes}
    costs = Costs(
        fresh_start_s=19.8, bind_s=0.05, capture_s=4.4, default_standby_bytes=2 * GiB, standby_bytes=by_shape
    )
    return Snapshot(0.0, tuple(gpus), tuple(backbones), tuple(workers), tuple(functions), costs)


def planner_ratios(
    seeds: range,
    num_gpus: int,
    gpu_bytes: int,
    num_backbones: int = 1,
    backbones_per_gpu: int = 1,
    max_items: int = 12,
) -> list[float]:
    """Greedy value / exact optimum of the warm-pool problem of small seeded snapshots (8 functions).

    Instances with no item or more than ``max_items`` items (too slow to solve exactly) are skipped.
    """
    from lorafn.controller.policy.account import accounts
    from lorafn.controller.policy.config import PolicyConfig
    from lorafn.controller.policy.exact import solve_exact
    from lorafn.controller.policy.knapsack import check_feasible, greedy
    from lorafn.controller.policy.planner import cold_demand, is_pool_worker, pool_problem

    config = PolicyConfig()
    out = []
    for seed in seeds:
        s = random_snapshot(
            seed,
            num_functions=8,
            num_gpus=num_gpus,
            num_backbones=num_backbones,
            num_shapes=3,
            gpu_bytes=gpu_bytes,
            max_standby_per_gpu=3,
            backbones_per_gpu=backbones_per_gpu,
        )
        free = {g: a.free_bytes for g, a in accounts(s, config.gpu_utilization).items()}
        cold = cold_demand(s.functions, set(), s.costs.fresh_start_s)
        pp = pool_problem(s, free, [w for w in s.workers if is_pool_worker(w)], cold, config)
        if not pp.problem.items or len(pp.problem.items) > max_items:
            continue
        g = greedy(pp.problem)
        check_feasible(pp.problem, g.placement)
        e = solve_exact(pp.problem)
        if e.value > 0:
            out.append(g.value / e.value)
    return out
