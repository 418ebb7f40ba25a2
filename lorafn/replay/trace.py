"""Arrivals from the Azure LLM inference traces, mapped onto functions; prompts from GSM8K. Pure.

The traces (`../shared/data/azure_llm_2023_{code,conv}.csv`) are `TIMESTAMP,ContextTokens,GeneratedTokens`
rows over one hour. A replay takes `rate × duration` consecutive rows from a start offset and stretches or
compresses their timestamps linearly so that they span `duration`: the mean rate is the target and the
shape of the arrivals (bursts, gaps, hence the inter-arrival CoV) is the trace's own. Each request goes to
one of N functions drawn from a Zipf-like popularity (function 0 the most popular), seeded.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

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


def select_and_scale(
    rows: Sequence[TraceRow], start_s: float, rate_rps: float, duration_s: float
) -> list[tuple[float, TraceRow]]:
    """`round(rate × duration)` consecutive rows from `start_s` on, with arrival times (seconds from 0)
    stretched linearly so that the span from the first to the row after the last is `duration_s`."""
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
    factor = duration_s / (t_end - t0)
    return [((r.at_s - t0) * factor, r) for r in window[:count]]


def zipf_weights(num_functions: int, exponent: float) -> np.ndarray:
    """Popularity of functions 0..n-1: proportional to 1 / (rank+1)^exponent (exponent 0: uniform)."""
    if num_functions < 1:
        raise ValueError(f"functions: {num_functions} must be >= 1")
    if exponent < 0:
        raise ValueError(f"zipf exponent: {exponent} must be >= 0")
    w = 1.0 / np.arange(1, num_functions + 1, dtype=float) ** exponent
    return w / w.sum()


def assign_functions(count: int, num_functions: int, exponent: float, seed: int) -> list[int]:
    """A function index for each of `count` requests, drawn from `zipf_weights` with `seed`."""
    rng = np.random.default_rng(seed)
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
    out = []
    for i, ((at, row), fn) in enumerate(zip(arrivals, which, strict=True)):
        prompt_tokens = max(1, min(row.context_tokens, options.max_prompt_tokens))
        prompt = build_prompt(questions, offset + i, prompt_tokens if options.prompt_from_trace else 0)
        max_tokens = max(1, min(row.generated_tokens, options.max_output_tokens))
        out.append(PlannedRequest(i, at, functions[fn], prompt, prompt_tokens, max_tokens))
    return out


def describe_plan(plan: Sequence[PlannedRequest], duration_s: float) -> dict[str, float | int | str]:
    """Counts and shape of a plan: requests, mean rate, inter-arrival CoV and its workload class."""
    times = [p.at_s for p in plan]
    cov = interarrival_cov(times)
    return {
        "requests": len(plan),
        "rate_rps": len(plan) / duration_s if duration_s > 0 else math.nan,
        "interarrival_cov": round(cov, 3),
        "workload_class": workload_class(cov),
        "functions_used": len({p.function for p in plan}),
    }
