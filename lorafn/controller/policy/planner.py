"""The warm pool = pre-loading (DESIGN §7, PCKP, greedy): how many standby workers of which shape per GPU.

Items: the k-th standby worker of (backbone, shape), k = 1, 2, ... Its value is the load latency it
saves (``Costs.bind_saving_s``: fresh start - bind) times the rate at which it gets used: the chance
of k or more cold starts of that shape within one refill time T, per T. Cold starts are counted per
function (`ColdDemand`: a function with no idle bound worker starts cold on its first arrival only),
and their number in T is taken as Poisson. For k = 1 and small rates the value is saving x rate, the
value of DESIGN §7; further standbys of one shape are worth less and less (diminishing returns), and
stop being items once that chance falls below ``PolicyConfig.min_standby_probability``. Weight: the
standby's reservation, never smaller than the largest ``mem_bytes`` of the registered functions of its
shape that fit a GPU holding the backbone (or it could not take them; `standby_bytes`).

Bins: GPUs, capacity = free bytes left after the demand step plus the bytes of the standbys already
there (they are the pool being planned). Precedence: a standby only on a GPU holding its backbone,
the k-th only after the (k-1)-th; at most ``max_standby_per_gpu`` per backbone and GPU. Solved by
`knapsack.greedy`; an existing standby is the preferred bin of its item, so a stable load gives a
stable pool. Then each backbone's ``min_standby_per_gpu`` floor is met where memory allows, with
existing standbys first, else shape-agnostic ones. A standby of the popular shape smaller than one of
that shape's registered functions (started before it registered) does not meet the floor: a standby of
the right size is started beside it, and it is stopped once that one is ready (never for a replacement
that has no room beside it).

Out: a `PoolTarget` for every (gpu, backbone, shape) planned or present, Start for each missing
standby, Stop("pool_shrink") for each surplus one (still-starting ones before ready ones), except a
surplus standby younger than ``PolicyConfig.pool_min_age_s``, kept while memory allows (hysteresis).
Starts go most valuable first, and only into the start room left: the GPU's fresh-start slots
(``max_fresh_starts_per_gpu``) and its node's (`pool_start_room`: ``max_pool_starts_per_node``, none while
a request there waits for its function's first worker under ``pool_waits_for_demand``); a standby without
room is planned again next round, its target waiting with it.
Adapter caching in host memory is not planned here (the worker's adapter cache handles it).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lorafn.controller.policy.account import Ledger
from lorafn.controller.policy.actions import PoolTarget, Start, Stop
from lorafn.controller.policy.backoff import backoff_remaining_s
from lorafn.controller.policy.config import PolicyConfig
from lorafn.controller.policy.knapsack import Item, Problem, greedy
from lorafn.controller.policy.model import Costs, Function, Snapshot, Worker

Key = tuple[str, str | None]  # (backbone, shape); shape None = shape-agnostic


@dataclass(frozen=True)
class ColdDemand:
    """Expected cold starts per refill window, by (backbone, shape) and (backbone, None).

    A function that has no idle bound worker starts cold on its first arrival only (after that it
    has a worker), so over a window of ``window_s`` it contributes the chance of at least one
    arrival, ``1 - exp(-rate x window_s)``, not its whole rate: one hot function is one cold start.
    ``wake[key]`` sums those chances (the expected number of distinct cold functions arriving within one
    refill window); ``rate(key)`` = wake / window_s is the cold-start rate. A cold function with no
    observed arrivals counts at ``prior_rps`` (`PolicyConfig.cold_prior_rps`): every registered function
    without a worker may wake up, and the first burst comes before any rate is known.
    (How big a standby must be is `standby_bytes`'s: every registered function counts there, cold or not.)
    """

    wake: Mapping[Key, float]
    window_s: float
    members: Mapping[Key, tuple[Function, ...]] = field(default_factory=dict)
    key_of: Mapping[str, Key] = field(default_factory=dict)  # cold function -> its (backbone, shape)
    prior_rps: float = 0.0

    def arrival_rate(self, f: Function) -> float:
        """The rate a cold function counts at: observed, else the prior."""
        return f.arrival_rate if f.arrival_rate > 0 else self.prior_rps

    def rate(self, key: Key) -> float:
        return self.wake.get(key, 0.0) / self.window_s

    def without(self, names: set[str]) -> ColdDemand:
        """The same demand once the functions ``names`` are warm: only their keys are recomputed."""
        keys: set[Key] = set()
        for name in names:
            key = self.key_of.get(name)
            if key is not None:
                keys.update((key, (key[0], None)))
        if not keys:
            return self
        wake, members = dict(self.wake), dict(self.members)
        for k in keys:
            left = tuple(f for f in self.members[k] if f.name not in names)
            members[k] = left
            wake[k] = sum(1.0 - math.exp(-self.arrival_rate(f) * self.window_s) for f in left)
            if not left:
                del members[k], wake[k]
        key_of = {n: k for n, k in self.key_of.items() if n not in names}
        return ColdDemand(wake, self.window_s, members, key_of, self.prior_rps)


def cold_demand(
    functions: Iterable[Function], warm: set[str], window_s: float, prior_rps: float = 0.0
) -> ColdDemand:
    """``warm``: functions whose next arrival finds a worker: an idle bound one, or bound ones keeping up
    with an empty queue (or one in this plan). ``prior_rps``: the rate of a cold function never seen
    arriving (`ColdDemand`)."""
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s!r}")
    if not prior_rps >= 0:
        raise ValueError(f"prior_rps must be >= 0, got {prior_rps!r}")
    wake: dict[Key, float] = defaultdict(float)
    members: dict[Key, list[Function]] = defaultdict(list)
    key_of: dict[str, Key] = {}
    exp = math.exp
    for f in functions:
        rate = f.arrival_rate if f.arrival_rate > 0 else prior_rps
        if rate <= 0 or f.name in warm:
            continue
        p = 1.0 - exp(-rate * window_s)
        key_of[f.name] = (f.backbone, f.shape)
        for key in ((f.backbone, f.shape), (f.backbone, None)):
            wake[key] += p
            members[key].append(f)
    return ColdDemand(dict(wake), window_s, {k: tuple(v) for k, v in members.items()}, key_of, prior_rps)


def refill_s(costs: Costs, config: PolicyConfig) -> float:
    """The refill window: how long a used standby takes to be replaced."""
    return config.refill_s or costs.fresh_start_s or 1.0


def poisson_tail(mean: float, kmax: int, floor: float) -> list[float]:
    """[P(N >= 1), P(N >= 2), ...] for N ~ Poisson(mean): ``kmax`` terms at most, none below ``floor``."""
    out: list[float] = []
    if mean <= 0:
        return out
    term = math.exp(-mean)  # P(N = 0)
    cdf = term
    for k in range(1, kmax + 1):
        tail = 1.0 - cdf  # P(N >= k)
        if tail < floor:
            break
        out.append(tail)
        term *= mean / k
        cdf += term
    return out


def holds(snapshot: Snapshot) -> dict[str, list[str]]:
    """Backbone -> GPU ids that hold it (loaded there and allowed there), in snapshot order."""
    out: dict[str, list[str]] = {b.name: [] for b in snapshot.backbones}
    allowed = {b.name: set(b.gpus) for b in snapshot.backbones}
    for g in snapshot.gpus:
        for name in g.backbones:
            if name in out and (not allowed[name] or g.id in allowed[name]):
                out[name].append(g.id)
    return out


def is_pool_worker(w: Worker) -> bool:
    return w.state == "standby" or (w.state == "starting" and w.function is None)


def _keep_order(w: Worker) -> tuple[int, float, str]:
    """Which standby to keep first: ready ones, then the oldest."""
    return (0 if w.state == "standby" else 1, -w.age_s, w.id)


@dataclass(frozen=True)
class PoolProblem:
    problem: Problem
    info: Mapping[tuple, tuple[str, str | None, int]]  # item key -> (backbone, shape, bytes)


def standby_bytes(snapshot: Snapshot, key: Key) -> int:
    """A standby kept for ``key`` = (backbone, shape): big enough for every registered function of that
    shape, of any shape when ``key``'s shape is None (with a KV budget above the default a function could
    never take a default-sized standby: found on the H100 replay, where every cold start spawned a
    process). The cold functions are among the registered ones, so they need no term of their own."""
    return max(snapshot.costs.standby_bytes_for(key[1]), functions_need(snapshot, key))


def functions_need(snapshot: Snapshot, key: Key) -> int:
    """The largest ``mem_bytes`` of the registered functions of ``key`` = (backbone, shape) (any shape when
    it is None) that fit on a GPU holding the backbone: a standby smaller than that cannot take one of them
    (`decide.pick_standby` refuses it). 0 without such functions."""
    return _needs(snapshot).get(key, 0)


# (snapshot, its table): one pass over the functions per snapshot instead of one per key (a round asks for
# ~30 keys; with 1000 functions x 64 GPUs the per-key scans were ~15% of `decide`)
_needs_memo: tuple[Snapshot, dict[Key, int]] | None = None


def _needs(snapshot: Snapshot) -> dict[Key, int]:
    global _needs_memo
    memo = _needs_memo
    if memo is not None and memo[0] is snapshot:
        return memo[1]
    # a function that fits on no GPU holding the backbone gets its explicit error; it must not make every
    # standby of its shape too big to place
    room = backbone_room(snapshot)
    table: dict[Key, int] = {}
    for f in snapshot.functions:
        if f.mem_bytes > room.get(f.backbone, 0):
            continue
        for key in ((f.backbone, f.shape), (f.backbone, None)):
            if f.mem_bytes > table.get(key, 0):
                table[key] = f.mem_bytes
    _needs_memo = (snapshot, table)
    return table


def backbone_room(snapshot: Snapshot) -> dict[str, int]:
    """Backbone -> the most bytes a worker may take on one GPU that has it loaded (the GPU's size less its
    reserve and backbones; workers not counted): a function larger than that fits nowhere."""
    room: dict[str, int] = {}
    for g in snapshot.gpus:
        left = g.total_bytes - g.reserve_bytes - sum(g.backbones.values())
        for name in g.backbones:
            room[name] = max(room.get(name, left), left)
    return room


def awaiting_first_worker(snapshot: Snapshot, config: PolicyConfig) -> list[Function]:
    """Functions whose requests wait for their first worker: queued, none of their workers bound (one starts,
    a standby warms for it, or this round starts it), not backing off after failed starts (those wait for
    the backoff, not for a start), and small enough to fit a GPU holding the backbone (one that fits nowhere
    gets its 503, no start). What `pool_waits_for_demand` holds the pool for."""
    served = {w.function for w in snapshot.workers if w.state == "bound"}
    room = backbone_room(snapshot)
    return [
        f
        for f in snapshot.functions
        if f.queued > 0
        and f.name not in served
        and f.mem_bytes <= room.get(f.backbone, -1)
        and backoff_remaining_s(f, config.backoff_base_s, config.backoff_cap_s) <= 0
    ]


def pool_start_room(
    snapshot: Snapshot,
    config: PolicyConfig,
    starting_pool: Iterable[Worker],
    claimed: Mapping[tuple[str, str], int],
    where: Mapping[str, list[str]],
) -> dict[str, int] | None:
    """Node -> standby starts the pool may still begin there this round; None: no limit by node.

    ``max_pool_starts_per_node`` less the worker processes starting on the node: bound ones (a demand start
    uses the host's cores as a warm-up does), the pool's own that this plan keeps (``starting_pool``) and
    the claimed ones (``claimed``: (gpu, backbone) -> standbys still starting that demand waits for). Under
    ``pool_waits_for_demand``, 0 on every node holding the backbone of a function `awaiting_first_worker`:
    its start (or the standby it waits for) has the host to itself, and the pool refills once it is served.
    """
    cap, hold = config.max_pool_starts_per_node, config.pool_waits_for_demand
    if cap is None and not hold:
        return None
    node_of = {g.id: g.node for g in snapshot.gpus}
    unlimited = len(snapshot.workers) + sum(b.max_standby_per_gpu for b in snapshot.backbones) * len(node_of)
    room = {node: unlimited if cap is None else cap for node in node_of.values()}
    if cap is not None:
        for w in snapshot.workers:
            if w.state == "starting" and w.function is not None:
                room[node_of[w.gpu]] -= 1
        for w in starting_pool:
            room[node_of[w.gpu]] -= 1
        for (gpu, _backbone), n in claimed.items():
            room[node_of[gpu]] -= n
    if hold:
        for f in awaiting_first_worker(snapshot, config):
            for gpu in where.get(f.backbone, ()):
                room[node_of[gpu]] = 0
    return {node: max(0, n) for node, n in room.items()}


def pool_problem(
    snapshot: Snapshot,
    free: Mapping[str, int],
    pool: Iterable[Worker],
    cold: ColdDemand,
    config: PolicyConfig,
    where: Mapping[str, list[str]] | None = None,
    claimed: Mapping[tuple[str, str], int] | None = None,
) -> PoolProblem:
    """The knapsack instance of one round (see the module docstring). ``claimed``: (gpu, backbone) -> standbys
    still starting that this round's demand waits for (`decide`): pool processes until they bind, so they
    take their place under ``max_standby_per_gpu`` (the Kubernetes executor clamps pool pods to it: a
    replacement asked for beside them pushed the claimed pod out, and the function waited on a new one every
    round)."""
    where = holds(snapshot) if where is None else where
    capacity = {g: max(0, n) for g, n in free.items()}
    incumbents: dict[Key, list[Worker]] = defaultdict(list)
    for w in pool:
        capacity[w.gpu] = capacity.get(w.gpu, 0) + w.mem_bytes
        incumbents[(w.backbone, w.shape)].append(w)
    costs = snapshot.costs
    refill = cold.window_s
    items: list[Item] = []
    info: dict[tuple, tuple[str, str | None, int]] = {}
    limits: dict[tuple[str, str], int] = {}
    for b in snapshot.backbones:
        gpus = tuple(where.get(b.name, ()))
        if not gpus or b.max_standby_per_gpu == 0:
            continue
        for g in gpus:
            limits[(g, b.name)] = max(0, b.max_standby_per_gpu - (claimed or {}).get((g, b.name), 0))
        kmax = b.max_standby_per_gpu * len(gpus)
        shapes = sorted({s for (name, s) in cold.wake if name == b.name and s is not None})
        for shape in shapes:
            key = (b.name, shape)
            saving = costs.bind_saving_s(prepared=True)
            size = standby_bytes(snapshot, key)
            current = sorted(
                (w for w in incumbents.get(key, ()) if w.mem_bytes >= size and w.gpu in gpus), key=_keep_order
            )
            prev = None
            for k, tail in enumerate(poisson_tail(cold.wake[key], kmax, config.min_standby_probability), 1):
                item_key = ("standby", b.name, shape, k)
                items.append(
                    Item(
                        key=item_key,
                        value=saving * tail / refill,
                        weight=size,
                        bins=gpus,
                        group=b.name,
                        requires=prev,
                        preferred=current[k - 1].gpu if k <= len(current) else None,
                    )
                )
                info[item_key] = (b.name, shape, size)
                prev = item_key
    return PoolProblem(Problem(tuple(items), capacity, limits), info)


def plan_pool(
    snapshot: Snapshot,
    ledger: Ledger,
    pool: list[Worker],
    cold: ColdDemand,
    config: PolicyConfig,
    where: Mapping[str, list[str]] | None = None,
    start_slots: Mapping[str, int] | None = None,
    claimed: Mapping[tuple[str, str], int] | None = None,
) -> tuple[list[PoolTarget], list[Start | Stop]]:
    """Targets and the Start/Stop actions that reach them; updates ``ledger`` with them. ``start_slots``:
    fresh starts each GPU may still begin this round (`PolicyConfig.max_fresh_starts_per_gpu`; None: no
    cap); a standby without a slot is planned again next round and its target waits with it."""
    where = holds(snapshot) if where is None else where
    claimed = claimed or {}
    adapter_slots = {b.name: b.adapter_slots for b in snapshot.backbones}
    pp = pool_problem(snapshot, ledger.free, pool, cold, config, where, claimed)
    solution = greedy(pp.problem)
    room = dict(pp.problem.capacity)
    target: dict[tuple[str, str, str | None], int] = defaultdict(int)
    size_of: dict[tuple[str, str, str | None], int] = {}
    # the value of a place's most valuable item (0: kept for the floor only): starts go in that order, so that
    # the most valuable standby is the one that begins when start room is short
    value_of: dict[tuple[str, str, str | None], float] = defaultdict(float)
    item_value = {item.key: item.value for item in pp.problem.items}
    per_gpu_backbone: dict[tuple[str, str], int] = defaultdict(int)
    for item_key, gpu in solution.placement.items():
        backbone, shape, size = pp.info[item_key]
        target[(gpu, backbone, shape)] += 1
        size_of[(gpu, backbone, shape)] = size
        value_of[(gpu, backbone, shape)] = max(value_of[(gpu, backbone, shape)], item_value[item_key])
        per_gpu_backbone[(gpu, backbone)] += 1
        room[gpu] -= size

    existing: dict[tuple[str, str, str | None], list[Worker]] = defaultdict(list)
    for w in sorted(pool, key=_keep_order):
        existing[(w.gpu, w.backbone, w.shape)].append(w)
    keep: set[str] = set()
    for key, n in target.items():
        fitting = [w for w in existing.get(key, ()) if w.mem_bytes >= size_of[key]]
        keep.update(w.id for w in fitting[:n])

    # The floor: min_standby_per_gpu per backbone and GPU, existing standbys first (no churn).
    by_place: dict[tuple[str, str], list[Worker]] = defaultdict(list)
    for w in pool:
        by_place[(w.gpu, w.backbone)].append(w)

    def keep_existing(candidates: list[Worker], missing: int) -> int:
        """Keep existing standbys toward a floor while room allows; what is still missing."""
        for w in candidates:
            if missing == 0 or room[w.gpu] < w.mem_bytes:
                continue
            keep.add(w.id)
            target[(w.gpu, w.backbone, w.shape)] += 1
            size_of.setdefault((w.gpu, w.backbone, w.shape), w.mem_bytes)
            room[w.gpu] -= w.mem_bytes
            missing -= 1
        return missing

    def keep_interim(w: Worker, size: int) -> None:
        """Keep a too-small standby while its replacement (of ``size``) starts; it does not meet the floor."""
        if room[w.gpu] < w.mem_bytes:
            return
        keep.add(w.id)
        target[(w.gpu, w.backbone, w.shape)] += 1
        size_of.setdefault((w.gpu, w.backbone, w.shape), size)  # the replacement's size, not this one's
        room[w.gpu] -= w.mem_bytes

    for b in snapshot.backbones:
        # The floor's new standbys are prepared for the backbone's most popular shape (a bind into prepared
        # buffers takes milliseconds; a shape-agnostic standby must load and capture, seconds on a 7B).
        popular = popular_shape(snapshot, b.name)
        # what the popular shape's registered functions need of a standby (0 without functions)
        need = functions_need(snapshot, (b.name, popular)) if popular is not None else 0
        for gpu in where.get(b.name, ()):
            # (the floor, like the limit, counts the claimed standbys: pool processes until they bind)
            floor = min(b.min_standby_per_gpu, b.max_standby_per_gpu - claimed.get((gpu, b.name), 0))
            missing = floor - per_gpu_backbone[(gpu, b.name)]
            if missing <= 0:
                continue
            spare = [w for w in by_place.get((gpu, b.name), ()) if w.id not in keep]
            spare.sort(key=lambda w: _keep_order(w))
            # 1. standbys already prepared for the popular shape, big enough for its functions; 2. new ones
            # of that shape where there is room; 3. only then other standbys (an agnostic one left from before
            # any function existed is replaced once, when room allows: each later bind saves the load and
            # capture it would cost).
            size = standby_bytes(snapshot, (b.name, popular))
            # without functions there is no popular shape: any standby is as good (keep what exists)
            prepared = [w for w in spare if popular is None or (w.shape == popular and w.mem_bytes >= need)]
            # A standby of the popular shape started before a larger function of it registered could never
            # take that function: it does not meet the floor, a standby of the right size replaces it, and it
            # stays until that one is ready (it still takes the shape's smaller functions meanwhile).
            small = [w for w in spare if popular is not None and w.shape == popular and w.mem_bytes < need]
            others = [w for w in spare if w not in prepared and w not in small]
            missing = keep_existing(prepared, missing)
            replacing = iter(small)
            for w in prepared:  # replacements already starting: the standbys they replace stay
                if w.id in keep and w.state == "starting" and (old := next(replacing, None)) is not None:
                    keep_interim(old, size)
            # (`room` counts the pool's own bytes as free: a standby not kept is stopped in this same plan)
            while missing > 0:
                old = next(replacing, None)  # the too-small standby a new one replaces, if any is left
                if room[gpu] >= size + (old.mem_bytes if old is not None else 0):
                    if old is not None:
                        keep_interim(old, size)
                    target[(gpu, b.name, popular)] += 1
                    size_of.setdefault((gpu, b.name, popular), size)
                    room[gpu] -= size
                    missing -= 1
                elif old is not None:  # no room for a replacement beside it: it meets the floor, as before
                    missing = keep_existing([old], missing)
                else:
                    break
            missing = keep_existing(others, missing)

    # Hysteresis: a surplus standby of known age younger than pool_min_age_s stays while memory allows
    # (counted in its target, so no replacement starts); an unknown age (0) may be a stuck pod: not kept.
    for w in sorted(pool, key=_keep_order):
        if w.id in keep or not 0 < w.age_s < config.pool_min_age_s or room[w.gpu] < w.mem_bytes:
            continue
        keep.add(w.id)
        target[(w.gpu, w.backbone, w.shape)] += 1
        size_of.setdefault((w.gpu, w.backbone, w.shape), w.mem_bytes)
        room[w.gpu] -= w.mem_bytes

    actions: list[Start | Stop] = []
    for w in sorted(pool, key=lambda w: w.id):
        if w.id not in keep:
            # its memory is not given back to the ledger: the process holds it until it has exited (a start
            # in it now would die of OOM creating its CUDA context); the refill goes in once it is gone
            actions.append(Stop(w.id, "pool_shrink", w.gpu, f"{w.backbone}/{w.shape or 'any shape'}"))
    kept_count: dict[tuple[str, str, str | None], int] = defaultdict(int)
    for w in pool:
        if w.id in keep:
            kept_count[(w.gpu, w.backbone, w.shape)] += 1
    slots = None if start_slots is None else dict(start_slots)
    node_of = {g.id: g.node for g in snapshot.gpus}
    nodes = pool_start_room(
        snapshot, config, (w for w in pool if w.id in keep and w.state == "starting"), claimed, where
    )
    for key in sorted(target, key=lambda k: (-value_of[k], _key_order(k))):
        gpu, backbone, shape = key
        for _ in range(target[key] - kept_count[key]):
            size = size_of[key]
            # an incumbent bigger than the item took the room, or the GPU's fresh starts are at the cap, or
            # its node's start room is used up (or held for a request waiting for its first worker)
            if (
                not ledger.fits(gpu, size)
                or (slots is not None and slots.get(gpu, 0) <= 0)
                or (nodes is not None and nodes.get(node_of[gpu], 0) <= 0)
            ):
                target[key] -= 1
                continue
            if slots is not None:
                slots[gpu] -= 1
            if nodes is not None:
                nodes[node_of[gpu]] -= 1
            ledger.take(gpu, size)
            num_slots = adapter_slots.get(backbone, 1) if shape is not None else 1
            actions.append(Start(gpu, backbone, shape, None, size, "warm pool", num_slots))
    keys = set(target) | set(existing)
    pool_targets = [
        PoolTarget(g, b, s, target.get((g, b, s), 0)) for (g, b, s) in sorted(keys, key=_key_order)
    ]
    return pool_targets, actions


def popular_shape(snapshot: Snapshot, backbone: str) -> str | None:
    """The adapter shape of most of the backbone's arrivals (then of most of its functions); None without
    functions."""
    weight: dict[str, tuple[float, int]] = {}
    for f in snapshot.functions:
        if f.backbone == backbone:
            rate, count = weight.get(f.shape, (0.0, 0))
            weight[f.shape] = (rate + f.arrival_rate, count + 1)
    if not weight:
        return None
    return max(sorted(weight), key=lambda shape: weight[shape])


def _key_order(key: tuple[str, str, str | None]) -> tuple[str, str, int, str]:
    return (key[0], key[1], key[2] is not None, key[2] or "")
