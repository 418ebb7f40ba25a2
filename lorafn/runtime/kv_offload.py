"""KV offload to host memory (Vasuki): swap a preempted sequence's KV out, or recompute it (pure: no torch).

When the scheduler must preempt a sequence (an online request needs the KV blocks of a batch request,
or an older batch request those of a younger one), the sequence's computed KV can either be dropped and
prefilled again later (*recompute*), or copied to host memory now and back into free blocks when the
sequence is admitted again (*swap*). Which is cheaper depends on the sequence and the machine:

- swap: ``2 × bytes / host_link_bytes_per_s`` — the copy out now plus the copy in later, both on the
  worker's stream (the step waits for them);
- recompute: ``tokens × prefill_s_per_token`` — the prefill of every computed position again.

`OffloadPolicy.should_swap` picks swap when it is predicted faster *and* the sequence's blocks fit in
what is left of the worker's host budget (``host_budget_bytes``; over budget = recompute). Only sequences
of priority ``min_priority`` or above are swapped (default 1: offline batch requests, the ones online work
preempts; online requests preempted by older online ones keep the recompute path, so online latency never
waits on host copies). The
per-token prefill cost is measured by the engine from its own prefill steps (`observe_prefill`, an
exponentially weighted mean of step seconds per prompt token over steps that prefill at least
``min_measured_tokens`` tokens, so fixed per-step costs do not dominate); until then the configured
``prefill_s_per_token`` is the prior. Token results are the same either way (tests compare them).

The policy object also keeps the host-block account (`take`/`give`) and the counters a worker reports:
swaps out and in, bytes each way, recomputes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_HOST_BUDGET_BYTES = 2 << 30
# H100 host link: PCIe Gen5 x16 ~ 25 GB/s usable per direction (NVLink-C2C on GH200 ~ 5-10x more)
DEFAULT_HOST_LINK_BYTES_PER_S = 25e9
# a 7B model's prefill on one H100 is ~30-60 us per token at full batch; the engine measures its own
DEFAULT_PREFILL_S_PER_TOKEN = 50e-6


def _positive(value: float, name: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class OffloadConfig:
    """A worker's KV offload settings (`EngineConfig.kv_offload`).

    ``host_budget_bytes``: host memory the worker may hold swapped KV in (pinned on CUDA); 0 turns
    swapping off (every preemption recomputes). ``host_link_bytes_per_s``: the device<->host copy
    bandwidth the prediction uses. ``prefill_s_per_token``: the recompute prior until the engine has
    measured its own prefill steps. ``min_priority``: the lowest request priority that may be swapped
    (1: batch requests only; 0: every request)."""

    host_budget_bytes: int = DEFAULT_HOST_BUDGET_BYTES
    host_link_bytes_per_s: float = DEFAULT_HOST_LINK_BYTES_PER_S
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    min_measured_tokens: int = 64
    smoothing: float = 0.2  # weight of a new measurement in the mean
    min_priority: int = 1

    def __post_init__(self) -> None:
        budget = self.host_budget_bytes
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"host_budget_bytes must be an integer >= 0, got {budget!r}")
        _positive(self.host_link_bytes_per_s, "host_link_bytes_per_s")
        _positive(self.prefill_s_per_token, "prefill_s_per_token")
        tokens = self.min_measured_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"min_measured_tokens must be an integer >= 1, got {tokens!r}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing!r}")
        if isinstance(self.min_priority, bool) or self.min_priority not in (0, 1):
            raise ValueError(
                f"min_priority must be 0 (every request) or 1 (batch only), got {self.min_priority!r}"
            )


def swap_seconds(num_bytes: int, link_bytes_per_s: float) -> float:
    """Predicted time of a swap: out now and in later, each ``num_bytes`` over the host link."""
    return 2.0 * num_bytes / link_bytes_per_s


def recompute_seconds(num_tokens: int, prefill_s_per_token: float) -> float:
    """Predicted time to prefill ``num_tokens`` computed positions again."""
    return num_tokens * prefill_s_per_token


def should_swap(
    num_tokens: int, num_bytes: int, host_free_bytes: int, link_bytes_per_s: float, prefill_s_per_token: float
) -> bool:
    """Swap (True) or recompute (False) a preempted sequence with ``num_tokens`` computed positions held
    in ``num_bytes`` of KV blocks: swap when it fits the host budget left and moves faster than the
    prefill would recompute it."""
    if num_tokens <= 0 or num_bytes <= 0 or num_bytes > host_free_bytes:
        return False
    return swap_seconds(num_bytes, link_bytes_per_s) < recompute_seconds(num_tokens, prefill_s_per_token)


@dataclass
class OffloadStats:
    """Counters since the engine started (the worker's heartbeat reports them)."""

    swaps_out: int = 0
    swaps_in: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    recomputes: int = 0

    def as_fields(self) -> dict[str, int]:
        return {
            "kv_swaps_out": self.swaps_out,
            "kv_swaps_in": self.swaps_in,
            "kv_swap_out_bytes": self.swap_out_bytes,
            "kv_swap_in_bytes": self.swap_in_bytes,
            "kv_recomputes": self.recomputes,
        }


@dataclass
class OffloadPolicy:
    """One worker's swap decisions and host-block account. ``block_bytes``: bytes of one KV block (all
    layers, K and V); the budget in blocks is ``host_budget_bytes // block_bytes``."""

    config: OffloadConfig
    block_bytes: int
    stats: OffloadStats = field(default_factory=OffloadStats)
    host_blocks_used: int = 0

    def __post_init__(self) -> None:
        if (
            isinstance(self.block_bytes, bool)
            or not isinstance(self.block_bytes, int)
            or self.block_bytes < 1
        ):
            raise ValueError(f"block_bytes must be an integer >= 1, got {self.block_bytes!r}")
        self.prefill_s_per_token = self.config.prefill_s_per_token
        self.measured = False

    @property
    def num_host_blocks(self) -> int:
        return self.config.host_budget_bytes // self.block_bytes

    @property
    def host_free_blocks(self) -> int:
        return self.num_host_blocks - self.host_blocks_used

    def should_swap(self, num_tokens: int, num_blocks: int, priority: int = 1) -> bool:
        """Swap (True) or recompute a preempted sequence of ``priority`` (0 online, 1 batch)."""
        if priority < self.config.min_priority:
            return False
        return should_swap(
            num_tokens,
            num_blocks * self.block_bytes,
            self.host_free_blocks * self.block_bytes,
            self.config.host_link_bytes_per_s,
            self.prefill_s_per_token,
        )

    def take(self, num_blocks: int) -> None:
        """``num_blocks`` go out to host memory."""
        if num_blocks > self.host_free_blocks:
            raise RuntimeError(f"host KV budget: {num_blocks} blocks asked, {self.host_free_blocks} free")
        self.host_blocks_used += num_blocks
        self.stats.swaps_out += 1
        self.stats.swap_out_bytes += num_blocks * self.block_bytes

    def give(self, num_blocks: int, swapped_in: bool) -> None:
        """``num_blocks`` of host memory are free again: copied back in (``swapped_in``), or dropped with
        their sequence (finished or aborted while swapped out)."""
        if num_blocks > self.host_blocks_used:
            raise RuntimeError(
                f"host KV budget: {num_blocks} blocks given back, {self.host_blocks_used} held"
            )
        self.host_blocks_used -= num_blocks
        if swapped_in:
            self.stats.swaps_in += 1
            self.stats.swap_in_bytes += num_blocks * self.block_bytes

    def recomputed(self) -> None:
        self.stats.recomputes += 1

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that prefilled ``num_tokens`` prompt tokens took ``seconds``: the recompute cost learns."""
        if num_tokens < self.config.min_measured_tokens or not seconds > 0:
            return
        sample = seconds / num_tokens
        if not self.measured:
            self.prefill_s_per_token, self.measured = sample, True
            return
        a = self.config.smoothing
        self.prefill_s_per_token = (1 - a) * self.prefill_s_per_token + a * sample
