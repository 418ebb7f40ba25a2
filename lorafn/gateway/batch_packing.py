"""Pure packing policy of the batch runner (no I/O, no Redis): which batch requests to submit next.

After Vasuki (offline LLM batch inference): all prompts of a batch are known up front, so each request's
KV memory can be predicted — prompt tokens (counted by the gateway's tokenizer) + expected output tokens
(`max_tokens`, or a per-function estimate learned from answered requests), rounded up to whole KV blocks —
and requests packed greedily into *waves* that fit the function's workers' KV budgets. A wave that fits
runs without preemption (no recompute) and keeps the running batches full.

The runner is rolling: each tick it packs one wave into what the in-flight requests leave free
(`next_wave`), so a finished request's room is refilled at once instead of waiting for its whole wave.
Largest first (first-fit decreasing; for makespan, longest-processing-time first: the long requests
start early and the short ones fill the gaps at the end). `pack_waves` packs a whole batch at once (the
same rule); the tests and `bench/batch.py` use it to check and report the packing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    """One batch request as the packer sees it."""

    key: str  # the custom_id
    prompt_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens of {self.key!r} must be >= 1, got {self.prompt_tokens}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens of {self.key!r} must be >= 1, got {self.max_tokens}")


def predicted_tokens(item: Item, expected_output: int | None, block_size: int) -> int:
    """KV tokens the request will hold at its end: prompt + expected output (at most max_tokens),
    rounded up to whole blocks of `block_size` (the cache allocates blocks, not tokens)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    output = item.max_tokens if expected_output is None else max(1, min(item.max_tokens, expected_output))
    return math.ceil((item.prompt_tokens + output) / block_size) * block_size


def output_estimate(observed: Sequence[int], min_samples: int = 32, quantile: float = 0.9) -> int | None:
    """A per-function expected output length from the completion tokens of answered requests: their
    `quantile` (a high one: under-predicting costs preemptions and recompute, over-predicting only a
    less full batch). None (use max_tokens) until `min_samples` are known."""
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile}")
    if len(observed) < max(1, min_samples):
        return None
    ordered = sorted(observed)
    return max(1, ordered[min(len(ordered) - 1, math.ceil(quantile * len(ordered)) - 1)])


def order_for_packing(items: Sequence[Item], size: dict[str, int]) -> list[Item]:
    """Largest predicted size first (ties: input order, so packing is deterministic)."""
    return sorted(items, key=lambda it: -size[it.key])


def packing_room(kv_tokens: int, host_tokens: int, overcommit: float) -> int:
    """KV tokens the waves may be packed into: the workers' KV budgets, plus up to ``overcommit`` x that
    beyond them, within the workers' host KV budgets (``host_tokens``). Requests of a wave do not all
    reach their predicted size at once, so packing a little beyond the cache keeps it fuller; whatever does
    not fit when they grow is swapped to host memory by the worker (a batch request preempted by an older
    one, docs/batch.md#kv-offload), never more than the host budget holds."""
    if kv_tokens < 0 or host_tokens < 0:
        raise ValueError(f"kv_tokens, host_tokens must be >= 0, got {kv_tokens!r}, {host_tokens!r}")
    if not overcommit >= 0:
        raise ValueError(f"overcommit must be >= 0, got {overcommit!r}")
    return kv_tokens + min(host_tokens, int(overcommit * kv_tokens))


def next_wave(
    pending: Sequence[Item],
    size: dict[str, int],
    free_tokens: int | None,
    free_slots: int,
    nothing_in_flight: bool,
) -> list[Item]:
    """The requests to submit now: first fit, in `pending`'s order (`order_for_packing`), of the ones
    whose predicted size fits `free_tokens` (None: no KV figure known, count slots only), at most
    `free_slots` of them. A request larger than the whole free room goes alone when nothing is in
    flight (the worker's scheduler can still run it; it must not wait forever)."""
    if free_slots < 1 or not pending:
        return []
    wave: list[Item] = []
    room = free_tokens
    for item in pending:
        if len(wave) >= free_slots:
            break
        need = size[item.key]
        if room is None or need <= room:
            wave.append(item)
            if room is not None:
                room -= need
    if not wave and nothing_in_flight:
        wave = [pending[0]]
    return wave


def pack_waves(
    items: Sequence[Item], size: dict[str, int], capacity_tokens: int, max_seqs: int
) -> list[list[Item]]:
    """A whole batch in waves, each of at most `max_seqs` requests whose predicted sizes sum to at most
    `capacity_tokens` (first-fit decreasing bin packing; a request larger than the capacity gets a wave
    of its own). Every item lands in exactly one wave."""
    if capacity_tokens < 1 or max_seqs < 1:
        raise ValueError(f"capacity_tokens ({capacity_tokens}) and max_seqs ({max_seqs}) must be >= 1")
    waves: list[list[Item]] = []
    used: list[int] = []
    for item in order_for_packing(items, size):
        need = size[item.key]
        for i, wave in enumerate(waves):
            if len(wave) < max_seqs and used[i] + need <= capacity_tokens:
                wave.append(item)
                used[i] += need
                break
        else:
            waves.append([item])
            used.append(need)
    return waves
