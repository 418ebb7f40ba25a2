"""Trace parsing, window selection and scaling, popularity mapping and prompts (pure functions)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lorafn.replay.trace import (
    CHARS_PER_TOKEN,
    WARMUP_STREAM,
    PlanOptions,
    TraceRow,
    assign_functions,
    build_prompt,
    describe_plan,
    function_names,
    interarrival_cov,
    load_questions,
    parse_trace,
    plan_requests,
    scale_window,
    select_and_scale,
    select_warmup,
    window_facts,
    workload_class,
    zipf_weights,
)

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
CSV = [
    "TIMESTAMP,ContextTokens,GeneratedTokens",
    "2023-11-16 18:17:04.0319600,3180,8",
    "2023-11-16 18:17:03.9799600,4808,10",
    "2023-11-16 18:17:05.5000000,100,200",
]


def test_parse_trace_sorts_and_counts_from_the_first_request() -> None:
    rows = parse_trace(CSV)
    assert [r.context_tokens for r in rows] == [4808, 3180, 100]
    assert rows[0].at_s == 0.0
    assert rows[1].at_s == pytest.approx(0.052, abs=1e-6)  # 7 fractional digits parsed
    assert rows[2].at_s == pytest.approx(1.52004, abs=1e-6)
    assert rows[2].generated_tokens == 200


def test_parse_trace_refuses_bad_input_naming_it() -> None:
    with pytest.raises(ValueError, match="expected the columns"):
        parse_trace(["time,a,b", "1,2,3"])
    with pytest.raises(ValueError, match="line 3"):
        parse_trace([CSV[0], CSV[1], "yesterday,1,2"])
    with pytest.raises(ValueError, match="no rows"):
        parse_trace([CSV[0]])


@pytest.mark.skipif(not (DATA / "azure_llm_2023_code.csv").exists(), reason="no shared data")
def test_the_shared_traces_have_the_readme_shape() -> None:
    code = parse_trace(DATA / "azure_llm_2023_code.csv")
    conv = parse_trace(DATA / "azure_llm_2023_conv.csv")
    assert len(code) == 8819 and len(conv) == 19366
    code_cov = interarrival_cov([r.at_s for r in code])
    conv_cov = interarrival_cov([r.at_s for r in conv])
    assert 10 < code_cov < 16 and workload_class(code_cov) == "bursty"
    assert 1.0 < conv_cov < 1.3 and workload_class(conv_cov) == "normal"


def test_workload_class_boundaries() -> None:
    assert [workload_class(c) for c in (0.5, 1.0, 1.01, 4.0, 4.01)] == [
        "predictable", "predictable", "normal", "normal", "bursty",
    ]  # fmt: skip
    assert interarrival_cov([0.0, 1.0, 2.0, 3.0]) == 0.0  # evenly spaced
    assert interarrival_cov([0.0]) == 0.0


def _rows(times: list[float]) -> list[TraceRow]:
    return [TraceRow(t, 10 * i + 1, i + 1) for i, t in enumerate(times)]


def test_select_and_scale_keeps_the_shape_and_hits_the_rate() -> None:
    rows = _rows([0.0, 1.0, 1.5, 10.0, 11.0, 20.0])
    # 2 requests/s × 2 s = 4 rows from t >= 1: 1.0, 1.5, 10.0, 11.0; the 5th (20.0) closes the span
    got = select_and_scale(rows, start_s=0.5, rate_rps=2.0, duration_s=2.0)
    assert [r.at_s for _, r in got] == [1.0, 1.5, 10.0, 11.0]
    times = [t for t, _ in got]
    factor = 2.0 / (20.0 - 1.0)
    assert times == pytest.approx([0.0, 0.5 * factor, 9.0 * factor, 10.0 * factor])
    assert all(0 <= t < 2.0 for t in times)
    # gaps keep their ratios: the trace's burstiness survives the scaling
    assert interarrival_cov(times) == pytest.approx(interarrival_cov([1.0, 1.5, 10.0, 11.0]))


def test_select_and_scale_refuses_what_the_trace_cannot_give() -> None:
    rows = _rows([0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="rate × duration = 5 requests"):
        select_and_scale(rows, 0.0, 1.0, 5.0)
    with pytest.raises(ValueError, match="rate"):
        select_and_scale(rows, 0.0, 0.0, 5.0)
    with pytest.raises(ValueError, match="duration"):
        select_and_scale(rows, 0.0, 1.0, -1.0)
    with pytest.raises(ValueError, match="one timestamp"):
        select_and_scale(_rows([1.0, 1.0, 1.0]), 0.0, 1.0, 2.0)


def test_zipf_weights_and_seeded_assignment() -> None:
    w = zipf_weights(4, 1.0)
    assert w.sum() == pytest.approx(1.0)
    assert w == pytest.approx(np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (1 + 1 / 2 + 1 / 3 + 1 / 4))
    assert zipf_weights(3, 0.0) == pytest.approx([1 / 3] * 3)
    with pytest.raises(ValueError, match="functions"):
        zipf_weights(0, 1.0)
    with pytest.raises(ValueError, match="exponent"):
        zipf_weights(3, -1.0)
    a = assign_functions(20_000, 4, 1.0, seed=7)
    assert a == assign_functions(20_000, 4, 1.0, seed=7)
    assert a != assign_functions(20_000, 4, 1.0, seed=8)
    share = np.bincount(a, minlength=4) / len(a)
    assert share == pytest.approx(w, abs=0.015)


def test_build_prompt_sizes_gsm8k_text() -> None:
    qs = ["one two three four five six seven eight nine ten", "alpha beta gamma delta", "x y z"]
    assert build_prompt(qs, 1, 0) == qs[1]
    short = build_prompt(qs, 0, 3)
    assert len(short) <= 3 * CHARS_PER_TOKEN and qs[0].startswith(short)
    long = build_prompt(qs, 2, 30)  # wraps around the questions
    assert long.startswith("x y z\none two") and len(long) <= 30 * CHARS_PER_TOKEN
    assert len(long) > 30 * CHARS_PER_TOKEN // 2
    with pytest.raises(ValueError, match="questions"):
        build_prompt([], 0, 3)


def test_load_questions(tmp_path: Path) -> None:
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "q1", "answer": "a"}) + "\n\n" + json.dumps({"question": "q2"}))
    assert load_questions(path) == ["q1", "q2"]
    path.write_text('{"answer": 1}\n')
    with pytest.raises(ValueError, match=r"g\.jsonl:1"):
        load_questions(path)


def test_plan_requests_is_deterministic_and_capped() -> None:
    rows = [TraceRow(i * 0.5, 2000 if i % 2 else 5, 300 if i % 3 else 1) for i in range(200)]
    qs = [f"question number {i} about apples and pears" for i in range(10)]
    fns = function_names(3)
    assert fns == ["replay/f000", "replay/f001", "replay/f002"]
    opts = PlanOptions(3, rate_rps=4.0, duration_s=10.0, seed=1, max_prompt_tokens=16, max_output_tokens=8)
    plan = plan_requests(rows, qs, fns, opts)
    assert plan == plan_requests(rows, qs, fns, opts)
    assert len(plan) == 40
    assert [p.index for p in plan] == list(range(40))
    assert all(0 <= p.at_s < 10.0 for p in plan)
    assert [p.at_s for p in plan] == sorted(p.at_s for p in plan)
    assert {p.max_tokens for p in plan} == {1, 8}  # min(trace, cap)
    assert {p.prompt_tokens for p in plan} == {5, 16}
    assert all(len(p.prompt) <= p.prompt_tokens * CHARS_PER_TOKEN for p in plan)
    assert {p.function for p in plan} <= set(fns)
    d = describe_plan(plan, 10.0)
    assert (
        d["requests"] == 40 and d["rate_rps"] == pytest.approx(4.0) and d["workload_class"] == "predictable"
    )
    with pytest.raises(ValueError, match="functions"):
        plan_requests(rows, qs, fns[:2], opts)
    with pytest.raises(ValueError, match="max prompt/output"):
        plan_requests(rows, qs, fns, PlanOptions(3, 4.0, 10.0, max_output_tokens=0))


def _bursty_rows(n: int) -> list[TraceRow]:
    """n rows with uneven gaps (bursts and pauses), token counts varying by row."""
    rng = np.random.default_rng(3)
    times = np.cumsum(rng.exponential(1.0, n) * rng.choice([0.1, 1.0, 5.0], n))
    return [TraceRow(float(t - times[0]), 100 + 37 * (i % 50), 1 + i % 90) for i, t in enumerate(times)]


def test_warmup_is_the_trace_before_the_window_at_its_scale_and_leaves_the_window_as_it_was() -> None:
    rows = _bursty_rows(600)
    qs = [f"question {i}: how many apples does Ann have" for i in range(37)]
    fns = function_names(5)
    base = PlanOptions(5, rate_rps=3.0, duration_s=40.0, trace_start_s=rows[300].at_s, seed=4,
                       max_prompt_tokens=64, max_output_tokens=16)  # fmt: skip
    cold = plan_requests(rows, qs, fns, base)
    warmed = plan_requests(rows, qs, fns, PlanOptions(**{**base.__dict__, "warmup_s": 25.0}))
    window = [p for p in warmed if not p.warmup]
    warmup = [p for p in warmed if p.warmup]
    # the measured window: exactly the requests (times, functions, prompts, sizes, indices) of the cold run
    assert window == cold and not any(p.warmup for p in cold)
    # the warm-up: the trace rows just before the window, at the window's own scale, in [-25, 0)
    w = scale_window(rows, base.trace_start_s, 3.0, 40.0)
    expected = [r for r in rows[: w.first] if (r.at_s - w.t0_s) * w.factor >= -25.0]
    assert len(warmup) == len(expected) > 10
    assert [p.at_s for p in warmup] == pytest.approx([(r.at_s - w.t0_s) * w.factor for r in expected])
    assert all(-25.0 <= p.at_s < 0 for p in warmup)
    assert [p.index for p in warmup] == list(range(-len(warmup), 0))  # in time order, before window's 0..
    assert [p.max_tokens for p in warmup] == [min(r.generated_tokens, 16) for r in expected]
    assert [p.prompt_tokens for p in warmup] == [min(r.context_tokens, 64) for r in expected]
    # sent first: the plan is in time order, the warm-up before the window
    assert warmed == sorted(warmed, key=lambda p: p.at_s) and warmed[: len(warmup)] == warmup
    # its functions are drawn from the same popularity by a stream of their own, not the window's draws
    assert [fns.index(p.function) for p in warmup] == assign_functions(len(warmup), 5, 1.0, 4, WARMUP_STREAM)
    # the count is what the trace had there, not rate × warm-up: its own shape, as the window keeps its
    assert describe_plan(warmed, 40.0) == describe_plan(cold, 40.0)
    facts = window_facts(rows, PlanOptions(**{**base.__dict__, "warmup_s": 25.0}))
    assert facts["trace_s"] == [pytest.approx(w.t0_s, abs=1e-3), pytest.approx(w.t_end_s, abs=1e-3)]
    assert facts["warmup_trace_s"][0] == pytest.approx(w.t0_s - 25.0 / w.factor, abs=1e-3)


def test_warmup_refuses_what_the_trace_cannot_give() -> None:
    rows = _bursty_rows(300)
    start = rows[20].at_s
    w = scale_window(rows, start, 2.0, 30.0)
    history = w.t0_s * w.factor  # replay seconds of trace before the window at its scale
    assert select_warmup(rows, start, 2.0, 30.0, 0.0) == []
    assert len(select_warmup(rows, start, 2.0, 30.0, history)) == 20  # every row before: just fits
    with pytest.raises(ValueError, match="--warmup-s or raise --trace-start"):
        select_warmup(rows, start, 2.0, 30.0, history * 1.01)
    with pytest.raises(ValueError, match="warm-up: -1"):
        select_warmup(rows, start, 2.0, 30.0, -1.0)
    opts = PlanOptions(2, 2.0, 30.0, trace_start_s=start, warmup_s=-1.0)
    with pytest.raises(ValueError, match="warm-up"):
        plan_requests(rows, ["q"], function_names(2), opts)


def test_function_streams_are_independent_draws_of_one_popularity() -> None:
    window = assign_functions(20_000, 4, 1.0, seed=7)
    warm = assign_functions(20_000, 4, 1.0, seed=7, stream=WARMUP_STREAM)
    assert window == assign_functions(20_000, 4, 1.0, seed=7, stream=0)  # the window's draws as before
    assert warm != window
    share = np.bincount(warm, minlength=4) / len(warm)
    assert share == pytest.approx(zipf_weights(4, 1.0), abs=0.015)
