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
- **Decode gating.** Admission orders prefills only; on a GPU without MPS each worker's CUDA context
  time-slices with the others, so a tight function's prefill is stretched by every other worker's decode
  steps. A grant is *urgent* when its margin is below `urgent_threshold_ms` (a fraction of its TTFT SLO,
  at least its own step time `T(b)`) and its deadline has not passed (`is_urgent`); while another worker
  of the GPU holds an urgent grant, a worker about to run a step with decodes (and no granted prefill of
  its own) pauses it (`DecodeGate`) until
  that prefill's step ends, at most its TPOT slack `tpotMs − T_decode(b)` (`decode_delay_bound_ms`) and at
  most once per step: every output token is delayed by at most that bound, and every step runs.
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


# -- decode gating ------------------------------------------------------------------------------
def urgent_threshold_ms(ttft_ms: float, t_ms: float, fraction: float) -> float:
    """The margin below which a grant is urgent: `fraction` of the TTFT SLO, and never less than the
    prefill step's own time `T(b)` (a margin smaller than the step itself is at risk whatever the SLO).
    0 (`fraction` 0): never urgent."""
    _check_ms(ttft_ms, "ttft_ms")
    _check_ms(t_ms, "t_ms")
    if not (isinstance(fraction, int | float) and 0 <= fraction <= 1):
        raise ValueError(f"urgent fraction must be in [0, 1], got {fraction!r}")
    if fraction == 0:
        return 0.0
    return max(fraction * ttft_ms, t_ms)


def is_urgent(deadline_ms: float, now_ms: float, active: int, t_ms: float, threshold_ms: float) -> bool:
    """A grant whose prefill the other workers' decodes should make room for: its margin
    `Δ = deadline − now − M·T(b)` is below `threshold_ms` (`urgent_threshold_ms`) and its deadline has
    not passed. A prefill already late is not rescued by pausing others: it would cost every other
    function's time per output token and save no violation. No deadline (+inf, offline batch requests)
    or a threshold of 0: never urgent. `lorafn/store/lua/gpu_admission.lua` marks grants the same way."""
    if threshold_ms <= 0 or math.isinf(deadline_ms):
        return False
    return deadline_ms > now_ms and margin_ms(deadline_ms, now_ms, active, t_ms) < threshold_ms


def decode_delay_bound_ms(tpot_ms: float, decode_step_ms: float) -> float:
    """The most one decode step (hence one output token) may be paused for another worker's urgent
    prefill: the TPOT slack `tpotMs − T_decode(b)`, so a token whose step takes its profiled time still
    meets the TPOT SLO. 0 when the step alone uses the whole SLO (never paused)."""
    _check_ms(tpot_ms, "tpot_ms")
    _check_ms(decode_step_ms, "decode_step_ms")
    return max(0.0, tpot_ms - decode_step_ms)


class DecodeGate:
    """One worker's decode gating state (pure: the caller does the Redis side and the waiting).

    `saw(urgent)` after each round trip that read the GPU's urgent grants (the worker ids holding one);
    `pause_ms(...)` before a step: how long it may wait (0: run now); `paused(...)` once it waited;
    `stepped()` after the step ran. The guarantees, whatever the urgent grants do: a step waits only
    while another worker holds an urgent grant, never longer than `bound_ms` (the caller's
    `decode_delay_bound_ms`), and at most once between two steps, so every step runs (no starvation)
    and every output token is delayed by at most the bound."""

    def __init__(self, worker: str, min_pause_ms: float = 5.0) -> None:
        _check_ms(min_pause_ms, "min_pause_ms")
        self.worker, self.min_pause_ms = worker, min_pause_ms
        self.urgent_elsewhere = False  # another worker's urgent grant was live at the last read
        self._paused = False  # paused since the last step
        self.gated_steps = 0  # steps that waited for an urgent prefill
        self.gated_ms = 0.0  # their total wait
        self.timeouts = 0  # waits that ran to the bound (the urgent step had not ended)

    def saw(self, urgent_workers: Iterable[str]) -> None:
        self.urgent_elsewhere = any(w != self.worker for w in urgent_workers)

    def pause_ms(self, decoding: int, prefilling: bool, bound_ms: float) -> float:
        """How long the next step may wait for another worker's urgent prefill (ms; 0: run now). Only a
        step with decodes waits (`decoding` > 0: the TPOT bound is what makes a wait safe), never a step
        that runs a granted prefill (`prefilling`: an urgent one, or a share of the budget that a pause
        would hold idle), never twice before a step, never when the slack is below `min_pause_ms` (the
        wait's round trip would cost more than it saves)."""
        _check_ms(bound_ms, "bound_ms")
        if not self.urgent_elsewhere or decoding <= 0 or prefilling or self._paused:
            return 0.0
        return bound_ms if bound_ms >= self.min_pause_ms else 0.0

    def paused(self, waited_ms: float, gated: bool, timed_out: bool) -> None:
        """The wait happened (`gated`: an urgent grant was still live when it began; `timed_out`: it ran
        to the bound). Either way no second wait before the next step."""
        self._paused, self.urgent_elsewhere = True, False
        if gated:
            self.gated_steps += 1
            self.gated_ms += max(0.0, waited_ms)
            self.timeouts += int(timed_out)

    def stepped(self) -> None:
        self._paused = False
