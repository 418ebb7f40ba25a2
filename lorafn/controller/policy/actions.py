"""What the controller asks for: the actions of one decision round, and the plan that holds them.

Actions are in the order to apply them: a Stop that makes room for a Start comes before it (the
driver must let the stopped worker release its memory before the new one allocates).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from lorafn.controller.policy.account import MemoryAccount

StopReason = Literal["offload", "scale_down", "pool_shrink", "keep_alive"]
# why an offload needed room: a function's first worker (a cold start), its min_replicas floor, or one
# more worker for a function whose queue grows (a burst)
OffloadCause = Literal["cold_start", "min_replicas", "scale_up"]
# why a ResizeKV: more KV for an offline batch or a burst, or a grant given back
ResizeCause = Literal["batch", "burst", "return", "join"]
# why a function with demand gets no worker this round: its start backoff after failures, its backbone
# unknown or loaded nowhere, a standby for it still warming up, every start slot taken
# (max_fresh_starts_per_gpu), workers stopped for its memory still exiting, or no memory anywhere
WaitCause = Literal["backoff", "no_backbone", "standby_warming", "start_slot", "making_room", "no_room"]


@dataclass(frozen=True)
class Bind:
    """Send bind(function) to standby worker ``worker_id``. ``prepared``: it has the shape's graphs;
    ``preloaded``: it holds the function's adapter already (the bind is registration only). ``join``: the
    worker is a bound one with a free adapter slot, serving other functions of the same namespace; it takes
    ``function`` in beside them (docs/runtime.md#adapter-slots)."""

    worker_id: str
    function: str
    gpu: str
    prepared: bool = True
    preloaded: bool = False
    join: bool = False


@dataclass(frozen=True)
class Preload:
    """Tell standby ``worker_id`` to load ``function``'s adapter into its LoRA buffers and stay a standby
    (it does not consume the function's requests; a later bind to another function overwrites them)."""

    worker_id: str
    function: str
    gpu: str
    value: float = 0.0  # seconds saved per second (load latency saved x cold arrival rate), for logs


@dataclass(frozen=True)
class Start:
    """Start a worker on ``gpu``: bound to ``function`` at once, or a standby when ``function`` is None.

    ``shape``: the adapter shape to prepare graphs for (None = shape-agnostic). ``mem_bytes``: its
    whole reservation, granted out of the GPU's account. ``reason``: why, for logs and status.
    """

    gpu: str
    backbone: str
    shape: str | None
    function: str | None
    mem_bytes: int
    reason: str
    # adapters its engine serves at once (`Backbone.adapter_slots`; docs/runtime.md#adapter-slots): 1 for a
    # shape-agnostic standby (slots are sized by a shape)
    adapter_slots: int = 1


@dataclass(frozen=True)
class Stop:
    """Stop worker ``worker_id`` (it exits; a bound worker never returns to the pool). For an offload,
    ``cause``: why the room was needed, ``victim``: "standby" or "idle_bound" (metrics by both),
    ``room_for``: the function that waits for this memory (`Worker.room_for` once it drains)."""

    worker_id: str
    reason: StopReason
    gpu: str = ""
    detail: str = ""
    cause: OffloadCause | None = None
    victim: str = ""
    room_for: str = ""


@dataclass(frozen=True)
class Park:
    """Tell idle bound worker ``worker_id`` to park (`PolicyConfig.park_idle`): release its KV cache and the
    graph pools that point into it, keep its process, CUDA context, adapter and backbone mapping, and stay
    ``function``'s worker. ``release_bytes``: what the account gets back. The plan counts that memory free at
    once (a later action of the same plan may use it), so a driver applies a Park synchronously: it sends it
    and waits for the worker's acknowledgement that the memory is released before the actions after it.
    ``room_for``: the function the room was made for ("" none)."""

    worker_id: str
    function: str
    gpu: str
    release_bytes: int
    detail: str = ""
    room_for: str = ""


@dataclass(frozen=True)
class Unpark:
    """Tell parked worker ``worker_id`` to take its KV cache back (``mem_bytes`` more out of the account)
    and serve ``function``'s queued requests (it re-captures its decode graphs lazily)."""

    worker_id: str
    function: str
    gpu: str
    mem_bytes: int


@dataclass(frozen=True)
class ResizeKV:
    """Tell bound worker ``worker_id`` to resize its KV cache to ``kv_bytes`` while its requests run: more
    KV (``delta_bytes`` > 0, taken from the account in this plan) while ``function`` has an offline batch
    backlog (`PolicyConfig.batch_kv_bytes`, docs/batch.md#kv-from-idle-memory) or online requests waiting
    behind its busy workers (`PolicyConfig.burst_kv_bytes`), or the function's own budget back once the
    worker has been idle (``delta_bytes`` < 0; the account sees it free once the worker reports it)."""

    worker_id: str
    function: str
    gpu: str
    kv_bytes: int
    delta_bytes: int
    detail: str = ""
    cause: ResizeCause = "batch"


@dataclass(frozen=True)
class Wait:
    """``function`` needs a worker and gets none this round; ``reason`` is for its waiting clients,
    ``cause`` the reason's kind (logs and metrics count by it)."""

    function: str
    reason: str
    cause: WaitCause


@dataclass(frozen=True)
class PoolTarget:
    """Desired number of standby workers of ``shape`` (None = shape-agnostic) for ``backbone`` on ``gpu``."""

    gpu: str
    backbone: str
    shape: str | None
    count: int


Action = Bind | Preload | Start | Stop | Park | Unpark | ResizeKV | Wait


@dataclass
class Plan:
    """The result of `decide`: actions in order, the standby pool targets, each GPU's memory account."""

    actions: list[Action] = field(default_factory=list)
    pool: list[PoolTarget] = field(default_factory=list)
    account: dict[str, MemoryAccount] = field(default_factory=dict)

    def of_type(self, kind: type) -> list:
        """The actions of one kind, in plan order (e.g. ``plan.of_type(Start)``)."""
        return [a for a in self.actions if isinstance(a, kind)]


def unbacked(actions: list[Action], failed: list[Park]) -> list[Action]:
    """The actions of a plan that counted on memory the ``failed`` parks (refused or not answered) did not
    release: the Start or Unpark of each one's ``room_for`` function on its GPU; for parks made for no one
    (`PolicyConfig.park_after_s`), Starts and Unparks on their GPU from the plan's end until their bytes are
    covered. Everything else stands: Stops and the other parks only free memory, and another function's
    action was planned with the memory that stays free (the account after the kept actions is at least as
    free as the plan's)."""
    rooms = {(p.gpu, p.room_for) for p in failed if p.room_for}
    short: dict[str, int] = {}
    for p in failed:
        if not p.room_for:
            short[p.gpu] = short.get(p.gpu, 0) + p.release_bytes
    # by position: two standby Starts of one shape are equal dataclasses
    takes: list[tuple[int, Start | Unpark]] = [
        (i, a) for i, a in enumerate(actions) if isinstance(a, (Start, Unpark))
    ]
    dropped = {i for i, a in takes if (a.gpu, a.function or "") in rooms}
    for i, a in reversed(takes):
        if short.get(a.gpu, 0) > 0 and i not in dropped:
            dropped.add(i)
            short[a.gpu] -= a.mem_bytes
    return [actions[i] for i in sorted(dropped)]
