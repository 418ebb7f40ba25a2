"""SLO-aware batching policy (pure: no torch, no Redis): DESIGN §7 "Batching", ServerlessLoRA §4.2.

Three decisions, each a plain function of numbers so that it is tested on its own:

- **Latency profile.** A worker times its engine steps and fits `T(b) = T0 + α·(b − 1)` (ms) per step
  kind (prefill: b = sequences prefilled in the step; decode: b = sequences decoded), by least squares
  over the recent steps (exponentially decayed, so a GPU that grows busier is seen). `Fit.max_batch`
  is the largest b with `T(b) <= SLO` (TTFT for prefill, TPOT for decode).
- **Fill or expire.** An idle worker whose queue is shorter than that batch holds its first prefill at
  most `d = SLO − T(N)` (N: the batch it fills toward) minus what the request already waited, so a full
  batch still meets the SLO; it holds only when another request is expected within that time (the
  recent inter-arrival time), so a lone request on a quiet function is never delayed for nothing.
- **Cross-function GPU admission.** The workers of one GPU that want to run a prefill step ask for a
  share of the GPU's prefill token budget (the tokens their step will prefill): several prefills run at
  once while they fit, and the GPU is never handed more prefill work at once than the budget. Waiters
  are served in the order of their deadline margin `Δ = SLO − (w + M·T(b))` (w: how long the oldest
  waiting request has waited, M: active batches on the GPU; with `deadline = arrival + SLO`,
  `Δ = deadline − now − M·T(b)`), and the first that does not fit stops the line, so a large prefill is
  never overtaken forever by small ones. `lorafn/store/lua/gpu_admission.lua` takes the same decision
  atomically in Redis; `admit` is its reference (tests compare the two).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

PREFILL = "prefill"
DECODE = "decode"
KINDS = (PREFILL, DECODE)


def _check_batch(b: int) -> int:
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise ValueError(f"batch size must be an integer >= 1, got {b!r}")
    return b


def _check_ms(value: float, what: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0 (ms), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Fit:
    """`T(b) = t0_ms + alpha_ms·(b − 1)`: the latency (ms) of a step over a batch of b sequences."""

    t0_ms: float
    alpha_ms: float
    samples: int = 0

    def __post_init__(self) -> None:
        _check_ms(self.t0_ms, "t0_ms")
        _check_ms(self.alpha_ms, "alpha_ms")

    def latency_ms(self, b: int) -> float:
        return self.t0_ms + self.alpha_ms * (_check_batch(b) - 1)

    def max_batch(self, slo_ms: float, limit: int) -> int:
        """Largest b in [1, limit] with `T(b) <= slo_ms`; 1 when even one sequence misses the SLO (a
        request is still served, alone, rather than never)."""
        _check_ms(slo_ms, "slo_ms")
        _check_batch(limit)
        if self.latency_ms(1) > slo_ms:
            return 1
        if self.alpha_ms == 0:
            return limit
        return max(1, min(limit, 1 + math.floor((slo_ms - self.t0_ms) / self.alpha_ms + 1e-9)))

    def to_fields(self) -> dict[str, str]:
        return {
            "t0_ms": f"{self.t0_ms:.4f}",
            "alpha_ms": f"{self.alpha_ms:.4f}",
            "samples": str(self.samples),
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> Fit | None:
        """A fit read back from Redis; None for a missing or damaged one (the worker measures anew)."""
        try:
            return cls(float(fields["t0_ms"]), float(fields["alpha_ms"]), int(fields.get("samples", 0)))
        except (KeyError, ValueError):
            return None


class LatencyProfile:
    """Weighted least squares of step latency (ms) against batch size, each older sample's weight
    multiplied by `decay` per new one (~1/(1 − decay) recent steps count). `prior` (a fit another worker
    of the same backbone, GPU model and adapter shape stored) answers until this worker has samples,
    and supplies the slope while it has seen a single batch size only."""

    def __init__(self, decay: float = 0.98, prior: Fit | None = None) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.decay, self.prior = decay, prior
        self.samples = 0
        self._w = self._b = self._t = self._bb = self._bt = 0.0

    def observe(self, b: int, ms: float) -> None:
        _check_batch(b)
        _check_ms(ms, "ms")
        d = self.decay
        self._w = self._w * d + 1
        self._b = self._b * d + b
        self._t = self._t * d + ms
        self._bb = self._bb * d + b * b
        self._bt = self._bt * d + b * ms
        self.samples += 1

    def fit(self) -> Fit | None:
        if self.samples == 0:
            return self.prior
        mean_b, mean_t = self._b / self._w, self._t / self._w
        var = self._bb / self._w - mean_b * mean_b
        if var > 1e-6 * max(1.0, mean_b * mean_b):
            alpha = max(0.0, (self._bt / self._w - mean_b * mean_t) / var)
        else:  # one batch size seen: no slope of its own
            alpha = self.prior.alpha_ms if self.prior else 0.0
        t0 = mean_t - alpha * (mean_b - 1)
        if t0 < 0:  # the line would cross zero: keep the mean, flatten the slope
            t0, alpha = 0.0, mean_t / (mean_b - 1) if mean_b > 1 else 0.0
        return Fit(t0, alpha, self.samples)


class ArrivalRate:
    """The recent mean time between arrivals (ms), an exponential moving average; None until two
    arrivals were seen."""

    def __init__(self, smoothing: float = 0.2) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.smoothing = smoothing
        self.interval_ms: float | None = None
        self._last_ms: float | None = None

    def arrived(self, at_ms: float, count: int = 1) -> None:
        if count < 1:
            return
        if self._last_ms is not None:
            gap = max(0.0, at_ms - self._last_ms) / count
            s = self.smoothing
            self.interval_ms = gap if self.interval_ms is None else (1 - s) * self.interval_ms + s * gap
        self._last_ms = at_ms


def hold_ms(
    fit: Fit | None, slo_ms: float, fill_to: int, waited_ms: float, interval_ms: float | None
) -> float:
    """How much longer (ms) an idle worker holds its first prefill for companions (fill or expire).

    `fill_to` = N, the batch it fills toward; the hold ends at `SLO − T(N)` after the oldest request
    arrived (`waited_ms` ago), so that request's prefill in a full batch still meets the SLO, and never
    lasts longer than one lone prefill, `T(1)`: the first request then pays at most its own prefill time
    again (waiting up to what going alone costs, the rent-or-buy rule), not the whole SLO slack. Without
    that cap a warm function's TTFT rose from 30 ms to ~1 s on the H100 (every request held to SLO −
    T(N) for companions that a closed-loop client never sends). 0 without a profile, when that time has
    passed, or when no companion is expected within the hold (the recent inter-arrival time
    `interval_ms` is unknown or longer)."""
    _check_ms(slo_ms, "slo_ms")
    _check_ms(waited_ms, "waited_ms")
    if fit is None or _check_batch(fill_to) < 2:
        return 0.0
    hold = min(slo_ms - fit.latency_ms(fill_to) - waited_ms, fit.latency_ms(1))
    if hold <= 0 or interval_ms is None or interval_ms > hold:
        return 0.0
    return hold


def margin_ms(deadline_ms: float, now_ms: float, active: int, t_ms: float) -> float:
    """Δ = SLO − (w + M·T(b)) = deadline − now − M·T(b): how much time is to spare if the request
    waits for the M active batches of the GPU, each taking about its own prefill time."""
    if active < 0:
        raise ValueError(f"active batches must be >= 0, got {active!r}")
    return deadline_ms - now_ms - active * t_ms


@dataclass(frozen=True)
class Waiter:
    """A worker that asks for a share of the GPU's prefill budget: its oldest waiting request's deadline
    (unix ms), the expected time of the prefill step it wants to run, `T(b)` (ms), and the prompt tokens
    that step prefills."""

    worker: str
    deadline_ms: float
    t_ms: float
    tokens: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"tokens must be an integer >= 1, got {self.tokens!r}")


def in_order(waiters: Iterable[Waiter], now_ms: float, active: int) -> list[Waiter]:
    """The waiters by deadline margin, smallest first; ties to the smaller worker id (as the Lua script)."""
    return sorted(waiters, key=lambda w: (margin_ms(w.deadline_ms, now_ms, active, w.t_ms), w.worker))


def pick(waiters: Iterable[Waiter], now_ms: float, active: int) -> Waiter | None:
    """The waiter served first: the smallest margin."""
    order = in_order(waiters, now_ms, active)
    return order[0] if order else None


def admit(
    waiters: Iterable[Waiter],
    now_ms: float,
    active: int,
    used_tokens: int,
    budget_tokens: int,
    wait_ms: float = 0.0,
) -> list[Waiter]:
    """The waiters granted now, in margin order, while their tokens fit in what the budget has left
    (`budget_tokens − used_tokens`, used = what the running prefill steps hold), or while they cannot
    afford to wait: a waiter whose margin is smaller than `wait_ms` (how long until the soonest running
    prefill is expected to end) goes at once, over the budget (a share is never pre-empted, so without
    this a tight function waited a whole long step of a looser one; the budget holds the loose ones
    back, never the urgent). The first waiter that neither fits nor is urgent stops the line: nobody
    behind it overtakes it, so it starts as soon as enough is freed (no starvation). One larger than the
    whole budget runs alone, once nothing is held."""
    if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 1:
        raise ValueError(f"budget_tokens must be an integer >= 1, got {budget_tokens!r}")
    if used_tokens < 0:
        raise ValueError(f"used_tokens must be >= 0, got {used_tokens!r}")
    granted: list[Waiter] = []
    for w in in_order(waiters, now_ms, active):
        urgent = margin_ms(w.deadline_ms, now_ms, active, w.t_ms) < wait_ms
        if used_tokens and used_tokens + w.tokens > budget_tokens and not urgent:
            break
        granted.append(w)
        used_tokens += w.tokens
    return granted
