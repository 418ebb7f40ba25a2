"""Arrivals from the Azure LLM inference traces, mapped onto functions; prompts from GSM8K. Pure.

The traces (`../shared/data/azure_llm_2023_{code,conv}.csv`) are `TIMESTAMP,ContextTokens,GeneratedTokens`
rows over one hour. A replay takes `rate × duration` consecutive rows from a start offset and stretches or
compresses their timestamps linearly so that they span `duration`: the mean rate is the target and the
shape of the arrivals (bursts, gaps, hence the inter-arrival CoV) is the trace's own. Each request goes to
one of N functions drawn from a Zipf-like popularity (function 0 the most popular), seeded.

A warm-up (`PlanOptions.warmup_s`) prepends the trace rows just before that window, scaled by the window's
own factor, so that the platform has seen traffic (and the controller arrival history) when the measured
window opens; the window's requests are exactly those of the same replay without a warm-up.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

# ServerlessLoRA's workload classes, by the inter-arrival coefficient of variation (shared/data/README.md).
PREDICTABLE_MAX_COV = 1.0
NORMAL_MAX_COV = 4.0
# A prompt sized "from the trace" is GSM8K text of about this many characters per wanted token (English
# text through a BPE tokenizer averages 3-5); the gateway's usage reports the true count.
CHARS_PER_TOKEN = 4.0


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: seconds since the trace's first request, and its token counts."""

    at_s: float
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a replay: when (seconds from the start), to which function, what to send."""

    index: int
    at_s: float
    function: str
    prompt: str
    prompt_tokens: int  # wanted (from the trace, capped), not necessarily what the tokenizer makes of it
    max_tokens: int
    # sent before the measured window (at_s < 0, index < 0): excluded from every figure of the window
    warmup: bool = False


def _parse_timestamp(text: str) -> float:
    """`2023-11-16 18:17:03.9799600` (7 fractional digits, which datetime does not parse) -> POSIX seconds."""
    whole, _, frac = text.strip().partition(".")
    try:
        base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
        fraction = float(f"0.{frac}") if frac else 0.0
    except ValueError:
        raise ValueError(f"TIMESTAMP {text!r}: expected 'YYYY-MM-DD HH:MM:SS[.fraction]'") from None
    return base.timestamp() + fraction


def parse_trace(lines: Sequence[str] | Path) -> list[TraceRow]:
    """Rows of an Azure LLM trace CSV (a path or its lines), sorted by time, times from the first row."""
    text_lines = Path(lines).read_text().splitlines() if isinstance(lines, Path) else list(lines)
    reader = csv.DictReader(text_lines)
    wanted = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
    if reader.fieldnames is None or not wanted <= set(reader.fieldnames):
        raise ValueError(f"trace header {reader.fieldnames}: expected the columns {sorted(wanted)}")
    raw: list[tuple[float, int, int]] = []
    for number, row in enumerate(reader, start=2):
        try:
            raw.append(
                (_parse_timestamp(row["TIMESTAMP"]), int(row["ContextTokens"]), int(row["GeneratedTokens"]))
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"trace line {number}: {exc}") from None
    if not raw:
        raise ValueError("trace: no rows")
    raw.sort(key=lambda r: r[0])
    t0 = raw[0][0]
    return [TraceRow(t - t0, max(0, c), max(0, g)) for t, c, g in raw]


def interarrival_cov(times: Sequence[float]) -> float:
    """Coefficient of variation (std / mean) of the gaps between sorted arrival times (0 for < 3 times)."""
    if len(times) < 3:
        return 0.0
    gaps = np.diff(np.sort(np.asarray(times, dtype=float)))
    mean = float(gaps.mean())
    return float(gaps.std() / mean) if mean > 0 else 0.0


def workload_class(cov: float) -> str:
    """ServerlessLoRA's class of a workload: predictable (CoV ≤ 1), normal (≤ 4), bursty (> 4)."""
    if cov <= PREDICTABLE_MAX_COV:
        return "predictable"
    return "normal" if cov <= NORMAL_MAX_COV else "bursty"


@dataclass(frozen=True)
class Window:
    """Where a replay's measured window lies in the trace: rows `[first, first + count)`, the first at
    `t0_s` trace seconds; the row after the last (`t_end_s`) closes the span, which is stretched by
    `factor` (replay seconds per trace second) to last the replay's duration."""

    first: int
    count: int
    t0_s: float
    t_end_s: float
    factor: float


def scale_window(rows: Sequence[TraceRow], start_s: float, rate_rps: float, duration_s: float) -> Window:
    """The measured window: `round(rate × duration)` consecutive rows from `start_s` on."""
    if rate_rps <= 0:
        raise ValueError(f"rate: {rate_rps} requests/s must be > 0")
    if duration_s <= 0:
        raise ValueError(f"duration: {duration_s} s must be > 0")
    if start_s < 0:
        raise ValueError(f"trace start: {start_s} s must be >= 0")
    count = max(1, round(rate_rps * duration_s))
    first = next((i for i, r in enumerate(rows) if r.at_s >= start_s), len(rows))
    window = rows[first : first + count + 1]
    if len(window) < count + 1:
        raise ValueError(
            f"rate × duration = {count} requests, but the trace has {max(0, len(window) - 1)} after "
            f"{start_s:g} s (of {len(rows)}): lower --rate or --duration, or start earlier"
        )
    t0, t_end = window[0].at_s, window[-1].at_s
    if t_end <= t0:
        raise ValueError(f"trace rows from {start_s:g} s all share one timestamp: cannot scale them")
    return Window(first, count, t0, t_end, duration_s / (t_end - t0))


def select_and_scale(
    rows: Sequence[TraceRow], start_s: float, rate_rps: float, duration_s: float
) -> list[tuple[float, TraceRow]]:
    """`round(rate × duration)` consecutive rows from `start_s` on, with arrival times (seconds from 0)
    stretched linearly so that the span from the first to the row after the last is `duration_s`."""
    w = scale_window(rows, start_s, rate_rps, duration_s)
    return [((r.at_s - w.t0_s) * w.factor, r) for r in rows[w.first : w.first + w.count]]


def select_warmup(
    rows: Sequence[TraceRow], start_s: float, rate_rps: float, duration_s: float, warmup_s: float
) -> list[tuple[float, TraceRow]]:
    """The rows before the measured window whose times, scaled by the window's own factor (so the
    warm-up has the window's scale: a busier stretch of trace sends more), fall in [-warmup_s, 0):
    `warmup_s` is replay (wall-clock) seconds, `warmup_s / factor` seconds of trace."""
    if warmup_s < 0:
        raise ValueError(f"warm-up: {warmup_s} s must be >= 0")
    w = scale_window(rows, start_s, rate_rps, duration_s)
    if warmup_s == 0:
        return []
    needed_trace_s = warmup_s / w.factor
    if needed_trace_s > w.t0_s - rows[0].at_s:
        raise ValueError(
            f"warm-up: {warmup_s:g} s at this scaling (×{w.factor:.3g}) needs {needed_trace_s:.0f} s of "
            f"trace before the window, which starts {w.t0_s - rows[0].at_s:.0f} s into the trace: lower "
            "--warmup-s or raise --trace-start"
        )
    out = [((r.at_s - w.t0_s) * w.factor, r) for r in rows[: w.first]]
    return [(t, r) for t, r in out if t >= -warmup_s]


def zipf_weights(num_functions: int, exponent: float) -> np.ndarray:
    """Popularity of functions 0..n-1: proportional to 1 / (rank+1)^exponent (exponent 0: uniform)."""
    if num_functions < 1:
        raise ValueError(f"functions: {num_functions} must be >= 1")
    if exponent < 0:
        raise ValueError(f"zipf exponent: {exponent} must be >= 0")
    w = 1.0 / np.arange(1, num_functions + 1, dtype=float) ** exponent
    return w / w.sum()


# `assign_functions` streams: the measured window draws from `seed` alone (as before warm-ups existed), the
# warm-up from an independent stream of the same seed, so a warm-up never changes the window's functions.
WINDOW_STREAM, WARMUP_STREAM = 0, 1


def assign_functions(
    count: int, num_functions: int, exponent: float, seed: int, stream: int = WINDOW_STREAM
) -> list[int]:
    """A function index for each of `count` requests, drawn from `zipf_weights` with `seed` (and a
    `stream` other than the window's: an independent draw of the same popularity)."""
    rng = np.random.default_rng(seed if stream == WINDOW_STREAM else [seed, stream])
    return [int(i) for i in rng.choice(num_functions, size=count, p=zipf_weights(num_functions, exponent))]


def load_questions(path: Path) -> list[str]:
    """The `question` of every line of a GSM8K JSONL file."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(str(json.loads(line)["question"]))
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{number}: expected a JSON object with a 'question'") from None
    if not out:
        raise ValueError(f"{path}: no questions")
    return out


def build_prompt(questions: Sequence[str], start: int, target_tokens: int) -> str:
    """GSM8K text of about `target_tokens` tokens (CHARS_PER_TOKEN): question `start`, and the next ones
    joined while it is shorter, cut at a word boundary; `target_tokens` ≤ 0: question `start` as it is."""
    if not questions:
        raise ValueError("questions: none to build a prompt from")
    first = questions[start % len(questions)]
    if target_tokens <= 0:
        return first
    want_chars = max(1, int(target_tokens * CHARS_PER_TOKEN))
    parts, size, i = [first], len(first), start + 1
    while size < want_chars:
        q = questions[i % len(questions)]
        parts.append(q)
        size += len(q) + 1
        i += 1
    text = "\n".join(parts)[:want_chars]
    cut = text.rfind(" ")
    return text[:cut] if cut > want_chars // 2 else text


@dataclass(frozen=True)
class PlanOptions:
    """What a replay sends: see `lorafn bench replay --help` for each."""

    num_functions: int
    rate_rps: float
    duration_s: float
    trace_start_s: float = 0.0
    zipf_exponent: float = 1.0
    seed: int = 0
    max_prompt_tokens: int = 512
    max_output_tokens: int = 64
    prompt_from_trace: bool = True  # False: the GSM8K question alone, whatever the trace's context size
    warmup_s: float = 0.0  # replay seconds of the trace before the window, sent first, measured apart


def function_names(num_functions: int, namespace: str = "replay") -> list[str]:
    """`replay/f000`, `replay/f001`, ...: function 0 is the most popular."""
    return [f"{namespace}/f{i:03d}" for i in range(num_functions)]


def plan_requests(
    rows: Sequence[TraceRow], questions: Sequence[str], functions: Sequence[str], options: PlanOptions
) -> list[PlannedRequest]:
    """The replay's requests in time order (pure: the same inputs give the same plan)."""
    if len(functions) != options.num_functions:
        raise ValueError(f"functions: {len(functions)} names for num_functions={options.num_functions}")
    if options.max_prompt_tokens < 1 or options.max_output_tokens < 1:
        raise ValueError(
            f"max prompt/output tokens: {options.max_prompt_tokens}/{options.max_output_tokens} must be >= 1"
        )
    arrivals = select_and_scale(rows, options.trace_start_s, options.rate_rps, options.duration_s)
    which = assign_functions(len(arrivals), options.num_functions, options.zipf_exponent, options.seed)
    offset = int(np.random.default_rng(options.seed + 1).integers(len(questions)))

    def planned(index: int, at: float, row: TraceRow, fn: int, warmup: bool) -> PlannedRequest:
        prompt_tokens = max(1, min(row.context_tokens, options.max_prompt_tokens))
        prompt = build_prompt(questions, offset + index, prompt_tokens if options.prompt_from_trace else 0)
        max_tokens = max(1, min(row.generated_tokens, options.max_output_tokens))
        return PlannedRequest(index, at, functions[fn], prompt, prompt_tokens, max_tokens, warmup)

    early = select_warmup(rows, options.trace_start_s, options.rate_rps, options.duration_s, options.warmup_s)
    early_which = assign_functions(
        len(early), options.num_functions, options.zipf_exponent, options.seed, WARMUP_STREAM
    )
    # warm-up request j of n is index j - n (-n..-1): time order, and the prompts run on into the window's
    # (question offset - 1 just before offset + 0)
    out = [
        planned(j - len(early), at, row, fn, True)
        for j, ((at, row), fn) in enumerate(zip(early, early_which, strict=True))
    ]
    out += [
        planned(i, at, row, fn, False) for i, ((at, row), fn) in enumerate(zip(arrivals, which, strict=True))
    ]
    return out


def window_facts(rows: Sequence[TraceRow], options: PlanOptions) -> dict[str, Any]:
    """Where the measured window and the warm-up lie in the trace (trace seconds), and the scale."""
    w = scale_window(rows, options.trace_start_s, options.rate_rps, options.duration_s)
    return {
        "trace_s": [round(w.t0_s, 3), round(w.t_end_s, 3)],
        "warmup_trace_s": [round(w.t0_s - options.warmup_s / w.factor, 3), round(w.t0_s, 3)],
        "factor": round(w.factor, 6),  # replay seconds per trace second
    }


def describe_plan(plan: Sequence[PlannedRequest], duration_s: float) -> dict[str, float | int | str]:
    """Counts and shape of a plan's measured window (its warm-up left out): requests, mean rate,
    inter-arrival CoV and its workload class."""
    window = [p for p in plan if not p.warmup]
    times = [p.at_s for p in window]
    cov = interarrival_cov(times)
    return {
        "requests": len(window),
        "rate_rps": len(window) / duration_s if duration_s > 0 else math.nan,
        "interarrival_cov": round(cov, 3),
        "workload_class": workload_class(cov),
        "functions_used": len({p.function for p in window}),
    }
