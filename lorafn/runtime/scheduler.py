"""Pure scheduling policy of the worker (no torch): continuous batching with chunked prefill.

One `Scheduler.schedule()` call plans one forward pass (one *step*) of the running batch, in the
stall-free order of Sarathi-Serve (Algorithm 3):

1. **decodes** of running sequences (one token each), oldest first: never delayed by prefills;
2. the **ongoing partial prefills**, oldest first, chunked to what is left of the token budget;
3. **new requests** from the waiting queue, strictly first come first served, while the budget,
   ``max_num_seqs`` and the KV blocks allow.

Priority is the *rank* ``(params.priority, arrival)``: the request class first (0 = online, 1 = an
offline batch request, docs/batch.md), then the arrival order (``Sequence.arrival``, lower = older).
So waiting online requests are admitted before any batch request, and batch requests only fill the
slots, token budget and blocks online ones leave. When KV blocks run out, a sequence may preempt
only running sequences of a larger rank, largest first (an online request preempts batch requests,
never the reverse); preempted sequences go back to the waiting queue in rank order,
so they are re-admitted before anything of larger rank. The unfinished sequence of smallest rank is
therefore never preempted, always fits (``max_model_len`` is capped to the cache size) and advances
every step: no deadlock, no starvation among online requests (batch requests wait for online ones).
See docs/scheduler.md for the policy, the reasons and a worked example.

A preempted sequence is recomputed (its KV dropped, prefilled again at re-admission) or, with an
`OffloadPolicy` (kv_offload.py, Vasuki) that predicts the copy faster than the prefill and has host
budget left, swapped: ``SchedulerOutput.swap_out`` lists the blocks to copy to host memory *before* the
step runs (they are free again in this very step), and at re-admission ``swap_in`` lists the new blocks
to copy the KV back into (also before the step); the sequence then goes on where it stopped (a decode,
or the rest of its prefill) instead of prefilling everything again. The engine runs all swap-outs, then
all swap-ins, then the forward.

**Deadline order** (``SchedulerConfig.deadline_order``, off by default; docs/scheduler.md#deadline-order):
requests may carry a TTFT deadline (`set_deadline`, absolute seconds on the clock whose ``now`` the
caller passes to `schedule`). Steps 2 and 3 then serve the pending prefills (partial and waiting ones
together) in the order of `deadline_plan`: earliest deadline first among those that can still make it
(Moore-Hodgson: the fewest predicted misses, with the prefill cost per token the engine measures), the
ones predicted late behind them, still served (never dropped), and any request overdue by
``overdue_after_s`` back in front (no starvation). A step stops adding prefill chunks where one more
would push a prompt that finishes in it on time past its deadline, so prompts are prefilled one after
another when time is short. A waiting request's admission then never preempts: it waits for free blocks.

The engine drives it::

    out = scheduler.schedule()
    # run the model on out.chunks; sample a token for each chunk with `samples` set
    for seq in scheduler.update(out, sampled):          # sampled: {seq_id: token_id}
        reason = stop_check(seq) or ("length" if scheduler.reached_max_model_len(seq) else None)
        if reason:
            scheduler.finish(seq.seq_id, reason)         # frees its blocks
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from lorafn.runtime.block_manager import BlockManager, blocks_for_tokens
from lorafn.runtime.kv_offload import OffloadPolicy
from lorafn.runtime.sequence import Sequence, SequenceStatus


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def rank(seq: Sequence) -> tuple[int, int]:
    """Admission order: request class (0 online before 1 batch), then arrival (older first)."""
    return (getattr(seq.params, "priority", 0), seq.arrival)


def _outranks(victim: Sequence, seq: Sequence, larger_class_only: bool = False) -> bool:
    """Whether ``seq`` may preempt ``victim``: a larger rank (a larger class, with ``larger_class_only``)."""
    return rank(victim)[0] > rank(seq)[0] if larger_class_only else rank(victim) > rank(seq)


def _chunk_tokens(
    num_tokens: int,
    budget: int,
    prefill_left: int,
    chunked: bool,
    first_prefill: bool,
    runs_alone: bool = False,
) -> int | None:
    """The tokens of a prefill's chunk in this step, or None when it waits for a later step.

    ``num_tokens``: what the prefill has left to compute; ``budget``: the step's token budget left;
    ``prefill_left``: what the grant leaves for prefill chunks (``max_prefill_tokens``); ``first_prefill``:
    the step has no prefill chunk yet. With ``chunked`` prefill: what the budget and the grant leave.
    Without, the prefill goes whole or waits: while it exceeds the budget (unless ``runs_alone``: a request
    longer than a whole step's budget runs alone once nothing else is running), and while it exceeds the
    grant unless it is the step's first prefill (an unsplittable prompt goes whole beyond the cap; later
    ones only while they fit)."""
    if chunked:
        return min(num_tokens, budget, prefill_left)
    if num_tokens > budget and not runs_alone:
        return None
    if num_tokens > prefill_left and not first_prefill:
        return None
    return num_tokens


@dataclass(frozen=True)
class DeadlinePlan:
    """The order in which a step serves the pending prefills (`deadline_plan`). ``late``: predicted to
    miss their deadline even if served next in line (they go behind the rest of their class); ``overdue``:
    past their deadline by more than ``overdue_after_s`` (back in front)."""

    order: list[Sequence]
    late: frozenset[str]
    overdue: frozenset[str]


def deadline_plan(
    pending: list[tuple[Sequence, int]],
    deadlines: Mapping[str, float],
    now: float,
    s_per_token: float,
    overdue_after_s: float = math.inf,
) -> DeadlinePlan:
    """Order the pending prefills ``pending`` = [(sequence, tokens it has left to prefill)] by TTFT deadline.

    Class first, as `rank` (online before batch). Within a class: (1) sequences that already have output
    tokens (preempted after their first token: no TTFT left to meet), by rank; (2) overdue ones (deadline
    + ``overdue_after_s`` < ``now``), by deadline; (3) those that can still meet their deadline, earliest
    deadline first; (4) the rest (predicted late, or without a deadline), by rank (first come first served).

    (3)/(4) is Moore-Hodgson's rule, with each prefill served one after another, the first token of the
    i-th at ``now + s_per_token x`` (tokens of everything before it and its own): walk in deadline order;
    when one would finish late, move the longest prefill so far (the latest deadline among equals, so with
    equal prompts the late one itself) to (4). On one server with every job present this misses the fewest
    deadlines. Pure; O(n log n)."""
    by_class: dict[int, list[tuple[Sequence, int]]] = {}
    for seq, tokens in pending:
        by_class.setdefault(rank(seq)[0], []).append((seq, tokens))
    order: list[Sequence] = []
    late: set[str] = set()
    overdue: set[str] = set()
    elapsed = 0  # tokens served before the walk's current point
    for cls in sorted(by_class):
        jobs = sorted(by_class[cls], key=lambda j: rank(j[0]))
        resumed = [j for j in jobs if j[0].num_output_tokens > 0]
        fresh = [j for j in jobs if j[0].num_output_tokens == 0]
        due = [j for j in fresh if j[0].seq_id in deadlines]
        over = sorted(
            (j for j in due if deadlines[j[0].seq_id] + overdue_after_s < now),
            key=lambda j: (deadlines[j[0].seq_id], rank(j[0])),
        )
        overdue.update(j[0].seq_id for j in over)
        edf = sorted(
            (j for j in due if j[0].seq_id not in overdue),
            key=lambda j: (deadlines[j[0].seq_id], rank(j[0])),
        )
        first = resumed + over
        elapsed += sum(t for _, t in first)
        kept: list[tuple[int, float, tuple[int, int], str]] = []  # max-heap: (-tokens, -deadline, -rank)
        dropped: set[str] = set()
        on_time = elapsed
        for seq, tokens in edf:
            deadline = deadlines[seq.seq_id]
            r = rank(seq)
            heapq.heappush(kept, (-tokens, -deadline, (-r[0], -r[1]), seq.seq_id))
            on_time += tokens
            if now + s_per_token * on_time > deadline:
                neg_tokens, _, _, seq_id = heapq.heappop(kept)
                on_time += neg_tokens
                dropped.add(seq_id)
        late.update(dropped)
        rest = sorted(
            [j for j in edf if j[0].seq_id in dropped] + [j for j in fresh if j[0].seq_id not in deadlines],
            key=lambda j: rank(j[0]),
        )
        order += [j[0] for j in first]
        order += [j[0] for j in edf if j[0].seq_id not in dropped]
        order += [j[0] for j in rest]
        elapsed = on_time + sum(t for _, t in rest)
    return DeadlinePlan(order, frozenset(late), frozenset(overdue))


@dataclass
class SchedulerConfig:
    """Limits of one worker's batch.

    - ``max_num_seqs``: most sequences running at once (holding KV blocks, scheduled per step).
    - ``max_num_batched_tokens``: token budget of one step (decode tokens + prefill chunk tokens).
      Must be >= ``max_num_seqs`` so that a full batch of decodes always fits.
    - ``block_size``, ``num_blocks``: the paged KV cache.
    - ``enable_chunked_prefill``: off = a prefill is scheduled whole or not at all. A prefill
      longer than the budget then runs alone, in a step of its own, once the running batch has
      drained (see docs/scheduler.md).
    - ``max_model_len``: longest sequence (prompt + output); ``None`` = what the cache holds.
      Capped to ``num_blocks * block_size`` (`Scheduler.max_model_len` is the effective value)
      so that any admitted sequence fits in the cache on its own.
    - ``deadline_order``: serve pending prefills by TTFT deadline (`deadline_plan`) instead of first come
      first served, when `schedule` is given ``now`` and requests have deadlines (`Scheduler.set_deadline`).
    - ``overdue_after_s``: a request this far past its deadline goes back in front of the ones that can
      still make theirs (the bound on how long a demoted request waits behind newer ones).
    - ``prefill_s_per_token``: the prefill cost prior for the deadline prediction when the scheduler has no
      `OffloadPolicy` (whose measured cost it uses otherwise).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None
    deadline_order: bool = False
    overdue_after_s: float = 5.0
    prefill_s_per_token: float = 50e-6

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): a full batch of decodes must fit in one step's budget"
            )
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be an integer >= 1 or None, got {self.max_model_len!r}")
        if not isinstance(self.deadline_order, bool):
            raise ValueError(f"deadline_order must be a bool, got {self.deadline_order!r}")
        for name in ("overdue_after_s", "prefill_s_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")


@dataclass
class ScheduledChunk:
    """Positions ``start .. start + num_tokens - 1`` of ``seq`` are computed this step.

    Their KV goes to the slots of those positions; attention sees positions ``0 .. start +
    num_tokens - 1``. ``samples``: the chunk ends at the sequence's last known token, so the
    logits of its last position are sampled (a decode, or the last chunk of a prefill).
    Read the fields before `Scheduler.update`, which advances the sequence.
    """

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool

    @property
    def seq_id(self) -> str:
        return self.seq.seq_id

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """Input tokens of this chunk (positions ``start .. end - 1``)."""
        return self.seq.token_ids_range(self.start, self.end)

    @property
    def is_decode(self) -> bool:
        """One token that continues an already computed context (a decode step)."""
        return self.num_tokens == 1 and self.start > 0 and self.samples


@dataclass
class SchedulerOutput:
    """One step's plan. ``chunks`` order: decodes, then partial prefills, then new requests.

    ``num_decodes``: the first ``num_decodes`` chunks are single-token decodes (the CUDA-graph part).
    ``preempted``: ids of sequences preempted in this step (their KV is gone; they will be
    prefilled again). ``finished``: sequences the scheduler itself finished in this step (only the
    safety net for ``max_model_len`` when the caller did not finish them; reason "length").
    ``swap_out`` / ``swap_in``: (seq_id, block ids) whose KV the engine copies to host memory / back from
    it before the forward, swap-outs first (a block swapped out may be a swap-in's target in one step).
    A swap-in's blocks hold positions ``0 .. len(blocks) * block_size - 1`` of the sequence, in order.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_decodes: int = 0
    finished: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[str, list[int]]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Iteration-level scheduler over a paged KV cache (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, offload: OffloadPolicy | None = None) -> None:
        self.config = config
        self.offload = offload  # None: every preemption recomputes
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        capacity = self.block_manager.capacity_tokens
        self.max_model_len = min(config.max_model_len or capacity, capacity)
        self._waiting: list[Sequence] = []  # sorted by rank; head = next to admit
        self._running: list[Sequence] = []  # sorted by rank
        self._seqs: dict[str, Sequence] = {}  # every unfinished sequence
        self._deadlines: dict[str, float] = {}  # seq_id -> its TTFT deadline (deadline_order)
        self._next_arrival = 0
        self.last_plan: DeadlinePlan | None = None  # the order the last step served prefills in (None: FCFS)

    # ------------------------------------------------------------------ requests in and out

    def add(self, seq: Sequence) -> None:
        """Queue a new request. Raises ValueError for an id in use, an empty or too long prompt."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"seq_id {seq.seq_id!r} is already in use by an unfinished request")
        if not seq.prompt_token_ids:
            raise ValueError(f"prompt_token_ids of {seq.seq_id!r} is empty: a prompt needs a token")
        if seq.num_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids of {seq.seq_id!r} has {seq.num_tokens} tokens, more than "
                f"max_model_len {self.max_model_len}"
            )
        if seq.block_table or seq.status is not SequenceStatus.WAITING or seq.swapped_tokens:
            raise ValueError(f"sequence {seq.seq_id!r} is not new (status {seq.status.value}, blocks held)")
        seq.num_computed_tokens = 0
        seq.finish_reason = None
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        # arrivals increase, so a new sequence goes after every waiting one of its class
        self._waiting.insert(bisect.bisect([rank(s) for s in self._waiting], rank(seq)), seq)
        self._seqs[seq.seq_id] = seq

    def set_deadline(self, seq_id: str, deadline: float | None) -> None:
        """The request's TTFT deadline (absolute seconds, the clock of `schedule`'s ``now``; None: none).
        Read only with ``deadline_order``; an unknown (finished) id is ignored."""
        if seq_id not in self._seqs:
            return
        if deadline is None:
            self._deadlines.pop(seq_id, None)
        elif isinstance(deadline, bool) or not isinstance(deadline, int | float) or math.isnan(deadline):
            raise ValueError(f"deadline of {seq_id!r} must be a number, got {deadline!r}")
        else:
            self._deadlines[seq_id] = float(deadline)

    def deadline_of(self, seq_id: str) -> float | None:
        return self._deadlines.get(seq_id)

    @property
    def prefill_s_per_token(self) -> float:
        """The prefill cost the deadline prediction uses: the engine's measured one (the `OffloadPolicy`
        learns it from the engine's prefill steps), else the configured prior."""
        if self.offload is not None:
            return self.offload.prefill_s_per_token
        return self.config.prefill_s_per_token

    def finish(self, seq_id: str, reason: str) -> Sequence | None:
        """Finish a sequence (``reason``: "stop", "length", "abort", ...) and free its blocks.

        Returns the sequence, or None when no unfinished sequence has this id (already finished:
        finishing twice is harmless and keeps the first reason).
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return None
        self._deadlines.pop(seq_id, None)
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self.block_manager.free(seq)
        if seq.swapped_tokens and self.offload is not None:  # its host copy is dropped by the engine
            self.offload.give(blocks_for_tokens(seq.swapped_tokens, self.config.block_size), swapped_in=False)
        seq.swapped_tokens = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        return seq

    def abort(self, seq_id: str) -> Sequence | None:
        """Drop a request (client gone); finish reason "abort"."""
        return self.finish(seq_id, "abort")

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def reset_blocks(self) -> None:
        """Every block free again (an unparked engine's new KV cache, `Engine.unpark`); only with no
        unfinished sequence (none holds blocks)."""
        if self._seqs:
            raise RuntimeError(f"reset_blocks: {len(self._seqs)} unfinished sequences hold blocks")
        self.block_manager = BlockManager(self.config.num_blocks, self.config.block_size)

    def get(self, seq_id: str) -> Sequence | None:
        return self._seqs.get(seq_id)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> list[Sequence]:
        return list(self._waiting)

    @property
    def running(self) -> list[Sequence]:
        return list(self._running)

    def reached_max_model_len(self, seq: Sequence) -> bool:
        """The sequence has generated a token and holds ``max_model_len`` tokens: finish it ("length")."""
        return seq.num_output_tokens > 0 and seq.num_tokens >= self.max_model_len

    # ------------------------------------------------------------------ one step

    @property
    def num_pending_prefills(self) -> int:
        """Sequences whose prompt (or recompute) is not yet fully computed: waiting ones and partial
        prefills. The worker asks its GPU's prefill slot while there are any (lorafn.runtime.slo)."""
        return len(self._waiting) + sum(1 for s in self._running if s.num_uncomputed_tokens > 1)

    @property
    def num_pending_online_prefills(self) -> int:
        """The pending prefills of online requests (priority 0). None: only offline batch requests wait to
        be prefilled, and the worker asks the GPU's prefill budget without a deadline (docs/batch.md)."""
        return sum(1 for s in self._waiting if rank(s)[0] == 0) + sum(
            1 for s in self._running if s.num_uncomputed_tokens > 1 and rank(s)[0] == 0
        )

    def pending_prefill_tokens(self, seq_ids: Collection[str] | None = None) -> int:
        """Prompt (or recompute) tokens the pending prefills still have to compute, of `seq_ids` only when
        given: what a step that prefilled all of them would prefill (the worker asks its GPU's prefill
        budget for these; a swapped-out sequence's KV comes back from host memory and is not counted)."""
        pending = [s for s in self._waiting] + [s for s in self._running if s.num_uncomputed_tokens > 1]
        if seq_ids is not None:
            wanted = set(seq_ids)
            pending = [s for s in pending if s.seq_id in wanted]
        return sum(
            s.num_tokens - s.swapped_tokens if s.status is SequenceStatus.WAITING else s.num_uncomputed_tokens
            for s in pending
        )

    def schedule(
        self, allow_prefill: bool = True, max_prefill_tokens: int | None = None, now: float | None = None
    ) -> SchedulerOutput:
        """Plan the next step (see the module docstring for the order and the rules).

        ``allow_prefill=False``: decodes only (steps 2 and 3 are skipped) — the worker runs its decodes
        while another function of the GPU holds the prefill slot; decodes are never held back.
        ``max_prefill_tokens``: the prefill chunks of the step (steps 2 and 3) compute at most this many
        tokens together — the share of the GPU's prefill budget the worker was granted; the rest of a
        prompt is chunked into later steps (decodes are not counted). Without chunked prefill a prompt
        cannot be split: the first prefill of the step goes whole even beyond the cap, later ones only
        while they fit. ``now``: the time on the deadlines' clock; with ``deadline_order`` the prefills are
        served in `deadline_plan` order (`last_plan`), without it first come first served."""
        if max_prefill_tokens is not None and (not _is_int(max_prefill_tokens) or max_prefill_tokens < 0):
            raise ValueError(
                f"max_prefill_tokens must be an integer >= 0 or None, got {max_prefill_tokens!r}"
            )
        cfg = self.config
        out = SchedulerOutput()
        # Safety net: never let a sequence outgrow the cache. Only running sequences can get there
        # (a waiting one was checked here before it was preempted, and has not grown since).
        for seq in [s for s in self._running if self.reached_max_model_len(s)]:
            out.finished.append(self.finish(seq.seq_id, "length"))  # type: ignore[arg-type]

        budget = cfg.max_num_batched_tokens
        # what the grant leaves for prefill chunks (partial prefills and new requests, not decodes)
        prefill_left = budget if max_prefill_tokens is None else max_prefill_tokens
        block_size = cfg.block_size
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        admitted: list[ScheduledChunk] = []
        scheduled: dict[str, tuple[ScheduledChunk, list[ScheduledChunk]]] = {}
        preempted_now: set[str] = set()
        swapped_in_now: set[str] = set()
        offload = self.offload
        # Blocks the sequences sampling in this step will need for their next decode (one-step
        # lookahead): a new request is admitted only if it leaves them free, so it is not
        # admitted just to be preempted by the next decode that crosses a block boundary.
        lookahead: dict[str, int] = {}
        lookahead_total = 0

        def preempt(victim: Sequence) -> None:
            nonlocal budget, lookahead_total, prefill_left
            lookahead_total -= lookahead.pop(victim.seq_id, 0)
            entry = scheduled.pop(victim.seq_id, None)
            if entry is not None:  # give back the chunk it had in this step
                chunk, group = entry
                group.remove(chunk)
                budget += chunk.num_tokens
                if group is not decodes:
                    prefill_left += chunk.num_tokens
            self._running.remove(victim)
            computed = victim.num_computed_tokens
            num_blocks = blocks_for_tokens(computed, block_size)
            if victim.seq_id in swapped_in_now:
                # admission runs in rank order and preempts only larger ranks: never the case
                raise RuntimeError(f"{victim.seq_id!r} preempted in the step that swaps it in")
            if (
                offload is not None
                and computed
                and offload.should_swap(computed, num_blocks, rank(victim)[0])
            ):
                # copied out before the step runs, so the freed blocks may be reused in this step
                out.swap_out.append((victim.seq_id, victim.block_table[:num_blocks]))
                offload.take(num_blocks)
                victim.swapped_tokens = computed
            elif offload is not None and computed:
                offload.recomputed()
            self.block_manager.free(victim)
            victim.num_computed_tokens = 0
            victim.status = SequenceStatus.WAITING
            victim.num_preemptions += 1
            keys = [rank(s) for s in self._waiting]
            self._waiting.insert(bisect.bisect(keys, rank(victim)), victim)
            preempted_now.add(victim.seq_id)
            out.preempted.append(victim.seq_id)

        def reserve(seq: Sequence, num_tokens: int, larger_class_only: bool = False) -> bool:
            """Blocks for positions 0 .. num_tokens - 1, preempting running sequences of larger rank
            (younger, or batch ones; only batch ones with ``larger_class_only``) if needed."""
            while not self.block_manager.can_allocate(seq, num_tokens):
                victim = next(
                    (
                        s
                        for s in reversed(self._running)
                        if s is not seq and _outranks(s, seq, larger_class_only)
                    ),
                    None,
                )
                if victim is None:
                    return False
                preempt(victim)
            self.block_manager.allocate(seq, num_tokens)
            return True

        def add_chunk(group: list[ScheduledChunk], seq: Sequence, num_tokens: int) -> None:
            nonlocal budget, lookahead_total, prefill_left
            start = seq.num_computed_tokens
            chunk = ScheduledChunk(seq, start, num_tokens, samples=start + num_tokens == seq.num_tokens)
            group.append(chunk)
            scheduled[seq.seq_id] = (chunk, group)
            budget -= num_tokens
            if group is not decodes:
                prefill_left -= num_tokens
            # Next step decodes position num_tokens: it needs capacity num_tokens + 1.
            if chunk.samples and seq.num_tokens + 1 > len(seq.block_table) * block_size:
                need = self.block_manager.num_blocks_needed(seq, seq.num_tokens + 1)
                if need:
                    lookahead[seq.seq_id] = need
                    lookahead_total += need

        # 1. Decodes, oldest first. A decode that finds no block and no younger sequence to preempt
        #    waits (keeps its blocks): only older sequences hold the cache, and they finish first.
        for seq in list(self._running):
            if budget < 1:
                break
            num_tokens = seq.num_tokens
            if seq.status is not SequenceStatus.RUNNING or num_tokens - seq.num_computed_tokens != 1:
                continue
            if len(seq.block_table) * block_size >= num_tokens or reserve(seq, num_tokens):
                add_chunk(decodes, seq, 1)

        def admit(seq: Sequence, num_tokens: int) -> None:
            """Start a waiting sequence (its blocks are allocated) with a first chunk of ``num_tokens``."""
            self._waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            keys = [rank(s) for s in self._running]
            self._running.insert(bisect.bisect(keys, rank(seq)), seq)
            group = admitted
            if seq.swapped_tokens:  # its KV comes back from host memory: it goes on where it stopped
                entry = (seq.seq_id, seq.block_table[: blocks_for_tokens(seq.swapped_tokens, block_size)])
                out.swap_in.append(entry)
                swapped_in_now.add(seq.seq_id)
                offload.give(len(entry[1]), swapped_in=True)  # type: ignore[union-attr]
                seq.num_computed_tokens, seq.swapped_tokens = seq.swapped_tokens, 0
                # keep the step's chunk order (decodes, partial prefills, new): a decode joins the decodes
                group = decodes if seq.num_uncomputed_tokens == 1 else prefills
            add_chunk(group, seq, num_tokens)

        # Both orders (first come first served, deadline) size chunks and admit requests by these two.
        def chunk_tokens(num_tokens: int, runs_alone: bool = False) -> int | None:
            """`_chunk_tokens` of a prefill with ``num_tokens`` left, in this step as planned so far."""
            first_prefill = not (prefills or admitted)
            return _chunk_tokens(
                num_tokens, budget, prefill_left, cfg.enable_chunked_prefill, first_prefill, runs_alone
            )

        def admission_chunk(seq: Sequence, larger_class_only: bool = False) -> int | None:
            """The first chunk of waiting ``seq`` if it may start in this step, or None (it waits). It needs:
            not preempted in this step (no ping-pong), a free slot (``max_num_seqs``), room in the budget and
            the grant (`_chunk_tokens`), and free blocks for its whole prompt beside the lookahead's (else it
            would starve a running decode next step; running ones finish first) unless a running sequence it
            may preempt (`_outranks`; a larger class only with ``larger_class_only``) can make room."""
            if seq.seq_id in preempted_now or len(self._running) >= cfg.max_num_seqs:
                return None
            left = seq.num_tokens - seq.swapped_tokens  # what is left to compute once swapped in
            num_tokens = chunk_tokens(
                left, runs_alone=not self._running and left > cfg.max_num_batched_tokens
            )
            if num_tokens is None:
                return None
            needed = self.block_manager.num_blocks_needed(seq, seq.num_tokens)
            can_preempt = bool(self._running) and _outranks(self._running[-1], seq, larger_class_only)
            if needed + lookahead_total > self.block_manager.num_free_blocks and not can_preempt:
                return None
            return num_tokens

        plan: DeadlinePlan | None = None
        if cfg.deadline_order and now is not None and allow_prefill:
            pending = [
                (s, s.num_uncomputed_tokens)
                for s in self._running
                if s.seq_id not in scheduled and s.num_uncomputed_tokens > 1
            ] + [(s, s.num_tokens - s.swapped_tokens) for s in self._waiting]
            plan = deadline_plan(pending, self._deadlines, now, self.prefill_s_per_token, cfg.overdue_after_s)
        self.last_plan = plan

        if plan is not None:
            # 2+3 by deadline (module doc): partial prefills and waiting requests in the plan's order. A
            # waiting request that cannot start stops later admissions (head of line, as below), not the
            # partial prefills after it (they hold their blocks). Admission preempts only a larger class.
            cost = self.prefill_s_per_token
            step_deadline = math.inf  # the earliest deadline of an on-time prompt that finishes in the step
            admitting = True
            for seq in plan.order:
                if budget < 1 or prefill_left < 1:
                    break
                running = seq.status is SequenceStatus.RUNNING
                if running:
                    num_tokens = chunk_tokens(seq.num_uncomputed_tokens)
                elif admitting:
                    num_tokens = admission_chunk(seq, larger_class_only=True)
                    admitting = num_tokens is not None
                else:
                    continue
                if num_tokens is None:
                    continue
                step_tokens = cfg.max_num_batched_tokens - budget + num_tokens
                if (prefills or admitted) and now + cost * step_tokens > step_deadline:
                    break  # one more prompt in this step would make an on-time first token late
                if running:
                    add_chunk(prefills, seq, num_tokens)  # its blocks were reserved at admission
                else:
                    if not reserve(seq, seq.num_tokens, larger_class_only=True):
                        admitting = False
                        continue
                    admit(seq, num_tokens)
                deadline = self._deadlines.get(seq.seq_id)
                if (
                    scheduled[seq.seq_id][0].samples
                    and deadline is not None
                    and seq.num_output_tokens == 0
                    and seq.seq_id not in plan.late
                    and now + cost * step_tokens <= deadline
                ):
                    step_deadline = min(step_deadline, deadline)
        else:
            # 2. Ongoing partial prefills, oldest first (their blocks were reserved at admission).
            for seq in list(self._running) if allow_prefill else []:
                if budget < 1 or prefill_left < 1:
                    break
                if (
                    seq.status is not SequenceStatus.RUNNING
                    or seq.seq_id in scheduled
                    or seq.num_uncomputed_tokens <= 1
                ):
                    continue
                num_tokens = chunk_tokens(seq.num_uncomputed_tokens)
                if num_tokens is not None and reserve(seq, seq.num_computed_tokens + num_tokens):
                    add_chunk(prefills, seq, num_tokens)

            # 3. New (or preempted) requests, first come first served: the head blocks the queue, so a
            #    large request is never overtaken forever by smaller ones. Admission reserves blocks for
            #    the whole prompt (+ output, after a preemption), so a partial prefill never stalls on
            #    memory and a decode needs at most one new block. An older, preempted request may preempt
            #    younger ones.
            while allow_prefill and self._waiting and budget > 0 and prefill_left > 0:
                seq = self._waiting[0]
                num_tokens = admission_chunk(seq)
                if num_tokens is None or not reserve(seq, seq.num_tokens):
                    break
                admit(seq, num_tokens)

        out.chunks = decodes + prefills + admitted
        out.num_decodes = len(decodes)
        out.num_batched_tokens = sum(c.num_tokens for c in out.chunks)
        return out

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Record that ``output`` ran: advance the computed tokens, append the sampled tokens.

        ``sampled`` maps the seq_id of every chunk with ``samples`` set to its new token. Chunks
        of sequences finished or aborted since `schedule` are skipped. Returns the sequences
        that got a new token, in chunk order; the caller checks their stop conditions and calls
        `finish`.
        """
        appended: list[Sequence] = []
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING or self._seqs.get(seq.seq_id) is not seq:
                continue
            if seq.num_computed_tokens != chunk.start:
                raise RuntimeError(
                    f"stale scheduler output for {seq.seq_id!r}: chunk starts at {chunk.start}, "
                    f"sequence has {seq.num_computed_tokens} computed tokens (update called twice?)"
                )
            seq.num_computed_tokens += chunk.num_tokens
            if chunk.samples:
                if seq.seq_id not in sampled:
                    raise ValueError(f"no sampled token for {seq.seq_id!r}, whose chunk samples")
                seq.output_token_ids.append(int(sampled[seq.seq_id]))
                appended.append(seq)
        return appended

    # ------------------------------------------------------------------ the next prefill's deadline

    def next_prefill_deadline(self, now: float) -> float | None:
        """The TTFT deadline of the prompt the next step's plan serves first among those it can still
        make on time: the earliest deadline of the online pending prefills that `deadline_plan` (at ``now``,
        over what `schedule` would plan now) predicts on time, i.e. its first tier-3 prompt. The worker asks
        its GPU's prefill budget with it (lorafn.runtime.batching): a late or overdue request, served too
        but not savable, must not win the GPU for its worker. None: first come first served
        (``deadline_order`` off), or no online pending prefill with a deadline is predicted on time (the
        caller falls back to its oldest request). Reads the state only (pure given it); O(n log n)."""
        if not self.config.deadline_order:
            return None
        pending = [(s, s.num_uncomputed_tokens) for s in self._running if s.num_uncomputed_tokens > 1]
        pending += [(s, s.num_tokens - s.swapped_tokens) for s in self._waiting]
        cfg = self.config
        plan = deadline_plan(pending, self._deadlines, now, self.prefill_s_per_token, cfg.overdue_after_s)
        for seq in plan.order:
            deadline = self._deadlines.get(seq.seq_id)
            if (
                rank(seq)[0] == 0
                and deadline is not None
                and seq.num_output_tokens == 0
                and seq.seq_id not in plan.late
                and seq.seq_id not in plan.overdue
            ):
                return deadline
        return None
