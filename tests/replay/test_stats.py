"""Percentiles, SLO violations, paths, GPU-seconds and cost, the paper comparison, the configurations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafn.replay import paper
from lorafn.replay.configs import CONFIGS, DEFAULT_CONFIGS, resolve, select_configs
from lorafn.replay.report import config_figures, peak_in_flight, throughput
from lorafn.replay.stats import (
    BoundEvent,
    MiB,
    RequestResult,
    Sample,
    WorkerSample,
    assign_paths,
    cost_effectiveness,
    cost_usd,
    decode_concurrency,
    decoding_functions,
    gpu_seconds,
    held_bytes,
    percentiles,
    reduction,
    slo_violated,
    summarize,
    summarize_all,
    unshared_gpu_seconds,
    worker_series,
)


def _ok(fn: str, sent: float, ttft: float, e2e: float, tokens: int = 5, cold: bool = False) -> RequestResult:
    return RequestResult(0, fn, sent, sent, 200, cold, "r", ttft, e2e, 10, tokens)


def test_percentiles_of_known_values() -> None:
    got = percentiles([*range(1, 101), None])
    assert got["p50"] == pytest.approx(50.5)
    assert got["p90"] == pytest.approx(90.1)
    assert got["p99"] == pytest.approx(99.01)
    assert got["mean"] == pytest.approx(50.5)
    assert percentiles([None, None]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_tpot_and_slo_violations() -> None:
    r = _ok("a/x", 0, ttft=100, e2e=500, tokens=5)
    assert r.tpot_ms == pytest.approx(100.0)  # 400 ms over 4 tokens after the first
    assert _ok("a/x", 0, 100, 500, tokens=1).tpot_ms is None
    assert not slo_violated(r, 100.0) and slo_violated(r, 99.9)
    failed = RequestResult(1, "a/x", 0, 0, 503, None, error="http 503: busy", e2e_ms=5)
    assert slo_violated(failed, 10_000)  # an unanswered request met no target
    with pytest.raises(ValueError, match="slo_ttft_ms"):
        slo_violated(r, 0)


def test_summarize_judges_each_function_by_its_own_slo() -> None:
    results = [
        _ok("a/x", 0, 150, 300),  # within a/x's 200
        _ok("a/x", 1, 250, 400),  # over
        _ok("a/y", 2, 250, 400),  # within a/y's 1000
        RequestResult(3, "a/y", 3, 3, 0, None, error="transport: ConnectError: refused", e2e_ms=1),
    ]
    assign_paths(results, [])
    s = summarize_all(results, {"a/x": 200.0, "a/y": 1000.0})
    o = s["overall"]
    assert (o["requests"], o["answered"], o["errors"]) == (4, 3, 1)
    assert o["error_kinds"] == {"transport": 1}
    assert o["slo_violations"] == 2 and o["slo_violation_rate"] == pytest.approx(0.5)
    assert s["functions"]["a/x"]["slo_violations"] == 1
    assert s["functions"]["a/y"]["slo_violations"] == 1
    assert s["functions"]["a/y"]["ttft_ms"]["p50"] == pytest.approx(250)
    assert o["paths"] == {"warm": 3, "none": 1}


def test_assign_paths_leaders_take_the_bound_path_followers_queue() -> None:
    results = [
        _ok("a/x", 0.0, ttft=2000, e2e=2500, cold=True),  # leads; bound by standby at 1.5 s
        _ok("a/x", 0.5, ttft=1600, e2e=2000, cold=True),  # during the cold start: queued
        _ok("a/x", 3.0, ttft=50, e2e=100),  # warm
        _ok("a/x", 100.0, ttft=9000, e2e=9500, cold=True),  # a later cold start: fresh at 108 s
        _ok("a/y", 1.0, ttft=300, e2e=400, cold=True),  # no event matched: cold
    ]
    events = [
        BoundEvent(-50.0, "a/x", "fresh", 10.0),  # before the replay: not this episode's
        BoundEvent(1.5, "a/x", "standby", 12.0),
        BoundEvent(108.0, "a/x", "fresh", 8000.0),
    ]
    assign_paths(results, events)
    assert [r.path for r in results] == ["standby", "queued", "warm", "fresh", "cold"]


def _sample(t: float, *workers: tuple[str, str, int]) -> Sample:
    return Sample(
        t, [WorkerSample(f"w{i}", st, "a/x", gpu, "bb", mem) for i, (st, gpu, mem) in enumerate(workers)]
    )


def test_held_bytes_and_gpu_seconds() -> None:
    dev = {"g0": 1000 * MiB, "g1": 1000 * MiB}
    bb = {"bb": 300 * MiB}
    s = _sample(0.0, ("serving", "g0", 100 * MiB), ("standby", "g0", 50 * MiB))
    # shared: one backbone copy per device, whether a worker runs there or not
    assert held_bytes(s, list(dev), bb, True, 10 * MiB) == {"g0": 470 * MiB, "g1": 300 * MiB}
    # private weights: a copy inside every worker, none on an empty device
    assert held_bytes(s, list(dev), bb, False, 0) == {"g0": 750 * MiB, "g1": 0}
    # a worker reporting its whole process (the driver's count) already includes its context
    whole = Sample(0.0, [WorkerSample("w", "serving", "f", "g0", "bb", 100 * MiB, whole_process=True)])
    assert held_bytes(whole, list(dev), bb, True, 10 * MiB) == {"g0": 400 * MiB, "g1": 300 * MiB}
    # ... and, without sharing, its private copy: nothing is added to it
    assert held_bytes(whole, list(dev), bb, False, 10 * MiB) == {"g0": 100 * MiB, "g1": 0}
    samples = [s, _sample(2.0), _sample(3.0, ("serving", "g1", 2000 * MiB))]
    # 0-2 s: g0 0.75 of a GPU; 2-3 s: nothing; 3-5 s: g1 full (capped at 1)
    assert gpu_seconds(samples, 5.0, dev, bb, False) == pytest.approx(2 * 0.75 + 0 + 2 * 1.0)
    assert gpu_seconds([], 5.0, dev, bb, False) == 0.0
    series = worker_series(samples)
    assert series["bound"] == [1, 0, 1] and series["standby"] == [1, 0, 0]
    assert series["worker_mib"] == [150, 0, 2000]


def test_gpu_seconds_from_the_window_start_count_no_warmup_sample() -> None:
    dev = {"g0": 1000 * MiB}
    samples = [
        _sample(-4.0, ("serving", "g0", 1000 * MiB)),  # warm-up only: the whole GPU, until -1
        _sample(-1.0, ("serving", "g0", 500 * MiB)),  # in force at the window's start: counts from 0 to 1
        _sample(1.0, ("serving", "g0", 250 * MiB)),  # 1 to 3
    ]
    assert gpu_seconds(samples, 3.0, dev, {}, True, start_s=0.0) == pytest.approx(1 * 0.5 + 2 * 0.25)
    assert gpu_seconds(samples, 3.0, dev, {}, True) == pytest.approx(3 * 1.0 + 2 * 0.5 + 2 * 0.25)
    # a start after every sample's time: only the last one, from the start on
    assert gpu_seconds(samples, 3.0, dev, {}, True, start_s=2.0) == pytest.approx(0.25)


def test_unshared_gpu_seconds_give_every_bound_worker_its_own_backbone_uncapped() -> None:
    dev = {"g0": 1000 * MiB, "g1": 1000 * MiB}
    bb = {"bb": 300 * MiB, "big": 900 * MiB}
    samples = [
        # 0-2 s: two bound workers on g0 (their own copies: 2 x (100 + 10 + 300)) and a standby (50 + 10,
        # no copy): 880 MiB of a 1000 MiB GPU
        _sample(
            0.0, ("serving", "g0", 100 * MiB), ("draining", "g0", 100 * MiB), ("standby", "g0", 50 * MiB)
        ),
        # 2-4 s: one worker of the larger backbone on each device: 2 x (100 + 10 + 900) = 2.02 GPUs, more
        # than the run's two: not capped (without sharing these workers would have needed a third GPU)
        Sample(2.0, [WorkerSample(f"w{g}", "serving", "f", g, "big", 100 * MiB) for g in ("g0", "g1")]),
    ]
    got = unshared_gpu_seconds(samples, 4.0, dev, bb, 10 * MiB)
    assert got == pytest.approx(2 * 0.88 + 2 * 2.02)
    # from the window's start only, like gpu_seconds; no sample or no device: nothing
    assert unshared_gpu_seconds(samples, 4.0, dev, bb, 10 * MiB, start_s=3.0) == pytest.approx(2.02)
    assert unshared_gpu_seconds([], 4.0, dev, bb) == 0.0
    assert unshared_gpu_seconds(samples, 4.0, {}, bb) == 0.0


def test_config_figures_are_the_measured_window_s_and_the_warmup_is_summarized_apart() -> None:
    dev, bb = {"g0": 1000 * MiB}, {"bb": 100 * MiB}
    warm = [
        RequestResult(-2, "a/x", -3.0, -3.0, 200, True, "r", 9000, 9500, 10, 5, warmup=True),
        RequestResult(-1, "a/x", -2.0, -2.0, 0, None, error="http 503: busy", e2e_ms=1, warmup=True),
    ]
    window = [_ok("a/x", 0.5, 100, 400), _ok("a/x", 1.0, 3000, 3500)]
    samples = [
        _sample(-3.5, ("serving", "g0", 900 * MiB), ("serving", "g0", 900 * MiB)),  # the start-up burst
        _sample(-0.5, ("serving", "g0", 200 * MiB)),
        _sample(2.0, ("serving", "g0", 100 * MiB), ("standby", "g0", 100 * MiB)),
    ]
    f = config_figures(warm + window, samples, 4.0, {"a/x": 2500.0}, dev, bb, True, 0, 3.6)
    o = f["summary"]["overall"]
    assert (o["requests"], o["answered"], o["slo_violations"]) == (2, 2, 1)
    assert o["ttft_ms"]["p50"] == pytest.approx(1550)
    wo = f["warmup"]["summary"]["overall"]
    assert (wo["requests"], wo["answered"], wo["errors"], wo["slo_violations"]) == (2, 1, 1, 2)
    assert wo["ttft_ms"]["p50"] == pytest.approx(9000)
    # 0-2 s: (200 + 100 backbone) / 1000; 2-4 s: (200 + 100) / 1000; the burst before 0 counts nothing
    assert f["gpu_seconds"] == pytest.approx(2 * 0.3 + 2 * 0.3)
    assert f["cost_usd"] == pytest.approx(1.2 / 3600 * 3.6)
    assert f["row"]["gpu_seconds"] == f["gpu_seconds"]
    # without sharing, the same workers: (200 + 100) / 1000 from 0 to 2, (100 + 100 + 100) / 1000 from 2 to 4
    assert f["gpu_seconds_unshared_same_workers"] == pytest.approx(2 * 0.3 + 2 * 0.3)
    assert f["row"]["gpu_seconds_unshared_same_workers"] == f["gpu_seconds_unshared_same_workers"]
    private = config_figures(warm + window, samples, 4.0, {"a/x": 2500.0}, dev, bb, False, 0, 3.6)
    assert private["gpu_seconds_unshared_same_workers"] is None
    assert f["peak_held_mib"] == pytest.approx(300) and f["peak_workers"] == 2  # not the burst's 1900 / 2
    # the window's requests only (the warm-up's first one, open from -3 to 6.5 s, would make it 2)
    assert f["throughput"]["peak_in_flight"] == 1
    assert f["throughput"]["requests_per_s"] == pytest.approx(2 / 4.0)  # 0.5 s to 4.5 s
    assert f["series"]["t_s"] == [-3.5, -0.5, 2.0]  # the plots keep the warm-up
    cold = config_figures(window, samples[2:], 4.0, {"a/x": 2500.0}, dev, bb, True, 0, 3.6)
    assert cold["warmup"]["summary"]["overall"]["requests"] == 0
    # decode concurrency is the window's too: the two window requests decode apart, one function each
    assert f["decode_concurrency"]["functions_p50"] == 1


def test_decoding_functions_counts_distinct_functions_at_the_middle_of_each_decode() -> None:
    reqs = [
        _ok("a", 0.0, 100, 2100),  # decodes 0.1-2.1 s, middle 1.1
        _ok("a", 0.5, 100, 1500),  # 0.6-2.0, middle 1.3: the same function counts once
        _ok("b", 1.0, 50, 1050),  # 1.05-2.05, middle 1.55
        _ok("c", 5.0, 100, 1100),  # alone
        _ok("d", 0.0, 3000, 3000, tokens=1),  # one token: no decode phase, no TPOT
        RequestResult(5, "e", 0.0, 0.0, 0, None, error="http 503", e2e_ms=900.0),
    ]
    got = [(r.function, r.sent_s, n) for r, n in decoding_functions(reqs)]
    assert got == [("a", 0.0, 2), ("a", 0.5, 2), ("b", 1.0, 2), ("c", 5.0, 1)]
    # replay.json's records read back (bench/replay_breakdown.py does this) give the same pairs
    back = [RequestResult.from_json(r.to_json()) for r in reqs]
    assert [(r.function, n) for r, n in decoding_functions(back)] == [
        (r.function, n) for r, n in decoding_functions(reqs)
    ]


def test_decode_concurrency_bins_tpot_and_the_time_each_decoding_function_adds() -> None:
    # ten functions decoding together at 70 ms a token, then one alone at 8 ms
    reqs = [_ok(f"f{i}", 0.0, 100, 100 + 70 * 10, tokens=11) for i in range(10)]
    reqs.append(_ok("solo", 100.0, 100, 100 + 8 * 10, tokens=11))
    dc = decode_concurrency(reqs, width=5)
    assert dc["bins"] == [
        {
            "functions": [1, 5],
            "requests": 1,
            "tpot_ms_p50": pytest.approx(8.0),
            "ms_per_function": pytest.approx(8.0),
        },
        {
            "functions": [6, 10],
            "requests": 10,
            "tpot_ms_p50": pytest.approx(70.0),
            "ms_per_function": pytest.approx(7.0),
        },
    ]
    assert dc["ms_per_function"] == pytest.approx(7.0) and dc["functions_p50"] == 10
    assert decode_concurrency([]) == {"bins": [], "ms_per_function": None, "functions_p50": None}
    with pytest.raises(ValueError, match="width"):
        decode_concurrency(reqs, width=0)


def test_cost_and_cost_effectiveness() -> None:
    assert cost_usd(7200, 2.5) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="usd_per_gpu_hour"):
        cost_usd(1, -1)
    # half the latency at a quarter of the cost: 8× as cost-effective
    assert cost_effectiveness(500, 1.0, 1000, 4.0) == pytest.approx(8.0)
    assert cost_effectiveness(None, 1.0, 1000, 4.0) is None
    assert reduction(13, 100) == pytest.approx(0.87)


def test_throughput_and_peak_in_flight() -> None:
    results = [
        _ok("a/x", 0, 10, 1000, tokens=10),
        _ok("a/x", 0.5, 10, 1000, tokens=10),
        _ok("a/x", 2.0, 10, 1000),
    ]
    assert peak_in_flight(results) == 2
    th = throughput(results)
    assert th["tokens_per_s"] == pytest.approx(25 / 3.0) and th["requests_per_s"] == pytest.approx(1.0)


def test_paper_ratios_and_targets() -> None:
    rows = {
        "full": {"ttft_ms_mean": 100.0, "e2e_ms_mean": 1000.0, "cost_usd": 1.0, "ttft_ms_p50": 50.0,
                 "gpu_seconds": 5.0, "slo_violation_rate": 0.01},
        "no-sharing": {"ttft_ms_mean": 400.0, "e2e_ms_mean": 2000.0, "cost_usd": 2.0, "ttft_ms_p50": 500.0,
                       "gpu_seconds": 100.0, "slo_violation_rate": 0.3},
        "no-warm-pool": {"ttft_ms_mean": 200.0, "e2e_ms_mean": 1100.0, "cost_usd": 1.0, "ttft_ms_p50": 80.0,
                         "gpu_seconds": 5.0, "slo_violation_rate": 0.1},
    }  # fmt: skip
    cmp = {r["config"]: r for r in paper.ablation_comparison(rows)}
    assert cmp["no-sharing"]["ttft_vs_full"] == pytest.approx(4.0)
    assert cmp["no-sharing"]["paper_ttft_vs_full"] == pytest.approx(2608 / 576)  # the 4.5×
    assert cmp["no-warm-pool"]["paper_row"] == "no pre-loading"
    assert cmp["no-warm-pool"]["paper_cost_vs_full"] == pytest.approx(9.48 / 7.53)
    shares = paper.gain_shares(rows, "ttft_ms_mean")
    assert shares == pytest.approx({"no-sharing": 0.75, "no-warm-pool": 0.25})
    t = paper.targets_check(rows)
    assert t["ttft_p50_reduction"] == pytest.approx(0.9) and t["ttft_p50_reduction_met"]
    assert t["gpu_seconds_reduction"] == pytest.approx(0.95) and t["gpu_seconds_reduction_met"]
    assert t["slo_violation_rate_met"]
    assert paper.targets_check({"full": rows["full"]})["ttft_p50_reduction"] is None
    assert t["gpu_seconds_reduction_same_workers"] is None  # no computed figure in these rows
    same = paper.targets_check(
        {"full": {**rows["full"], "gpu_seconds_unshared_same_workers": 40 * rows["full"]["gpu_seconds"]}}
    )
    assert same["gpu_seconds_reduction_same_workers"] == pytest.approx(0.975)
    assert same["gpu_seconds_unshared_same_workers"] == 40 * rows["full"]["gpu_seconds"]
    assert same["gpu_seconds_reduction_same_workers_met"] and same["gpu_seconds_reduction"] is None


def test_configs_selection_and_missing_switches() -> None:
    assert [c.name for c in select_configs("default")] == list(DEFAULT_CONFIGS)
    assert [c.name for c in select_configs("no-sharing,full,no-sharing")] == ["no-sharing", "full"]
    assert len(select_configs("all")) == len(CONFIGS)
    with pytest.raises(ValueError, match="unknown 'fast'"):
        select_configs("full,fast")
    with pytest.raises(ValueError, match="none given"):
        select_configs(" , ")
    fields = {"share_backbone", "warm_pool", "offloading"}
    assert resolve(CONFIGS["no-sharing"], fields) == ({"share_backbone": False}, False, None)
    _, _, why = resolve(CONFIGS["no-slo-admission"], fields)
    assert why is not None and "gpu_admission" in why
    # without a warm_pool switch, the Backbone's warmPool 0/0 turns the pool off instead
    assert resolve(CONFIGS["no-warm-pool"], {"share_backbone"}) == ({}, True, None)
    assert resolve(CONFIGS["no-warm-pool"], fields) == ({"warm_pool": False}, False, None)
    assert CONFIGS["always-on"].min_replicas == 1 and CONFIGS["always-on"].shares_backbone
    assert not CONFIGS["always-on-private"].shares_backbone


def test_every_configuration_is_a_valid_platform_config_and_parking_turns_park_idle_on() -> None:
    from lorafn.local.config import LocalConfig

    fields = set(LocalConfig.model_fields)
    for config in CONFIGS.values():
        local, _, why = resolve(config, fields)
        assert why is None, (config.name, why)  # this build has every switch a row needs
        LocalConfig(**local)  # each row's settings are accepted as they are
    local, _, _ = resolve(CONFIGS["parking"], fields)
    assert LocalConfig(**local).park_idle and LocalConfig(**local).gpu_admission
    # parked workers stay until memory is needed (the simulator's better setting, docs/benchmarks.md)
    assert LocalConfig(**local).parked_keep_alive_s == float("inf")
    assert LocalConfig(**local).park_after_s == float("inf")  # "parking" parks under memory pressure only
    # "parking-50": the same, and workers idle 50 s park without pressure (the simulator's best row)
    local50, _, _ = resolve(CONFIGS["parking-50"], fields)
    assert {k: v for k, v in local50.items() if k != "park_after_s"} == {
        k: v for k, v in local.items() if k != "park_after_s"
    }
    assert LocalConfig(**local50).park_after_s == 50.0 and LocalConfig(**local50).park_idle
    assert LocalConfig().park_idle  # on by default (the H100 replay); the parking rows say so explicitly
    # parked workers kept 300 s by default (the 10-minute H100 replay): "full" has it, "parked-function"
    # keeps the function's keep-alive (the default before)
    assert LocalConfig().parked_keep_alive_s == 300.0
    # bound workers idle 50 s park without pressure by default (the seventeenth session's H100 replays):
    # "full" has it, "park-on-pressure" takes it away (the default before)
    assert LocalConfig().park_after_s == 50.0
    pop, _, _ = resolve(CONFIGS["park-on-pressure"], fields)
    assert LocalConfig(**pop).park_after_s == float("inf") and LocalConfig(**pop).park_idle
    assert "park-on-pressure" not in DEFAULT_CONFIGS
    pf, _, _ = resolve(CONFIGS["parked-function"], fields)
    assert LocalConfig(**pf).parked_keep_alive_s is None and LocalConfig(**pf).park_idle
    assert "parking" not in DEFAULT_CONFIGS and "parking-50" not in DEFAULT_CONFIGS
    assert "parked-function" not in DEFAULT_CONFIGS
    # "burst-kv": full with KV for bursts (off by default, so not a default row either)
    burst, _, _ = resolve(CONFIGS["burst-kv"], fields)
    full_row, _, _ = resolve(CONFIGS["full"], fields)
    assert {k: v for k, v in burst.items() if k != "burst_kv_mib"} == full_row
    assert LocalConfig(**burst).burst_kv_mib == 1024 and LocalConfig().burst_kv_mib == 0
    assert "burst-kv" not in DEFAULT_CONFIGS
    # "full" parks (the default, said explicitly) and "no-parking" is its ablation row, by default
    full, _, _ = resolve(CONFIGS["full"], fields)
    off, _, _ = resolve(CONFIGS["no-parking"], fields)
    assert LocalConfig(**full).park_idle and not LocalConfig(**off).park_idle
    assert {k: v for k, v in off.items() if k != "park_idle"} == {
        k: v for k, v in full.items() if k != "park_idle"
    }
    assert "no-parking" in DEFAULT_CONFIGS


def test_a_warm_request_that_waited_for_an_unpark_takes_the_unparked_path() -> None:
    results = [
        _ok("a/x", 10.0, ttft=400, e2e=900),  # unparked at 10.2 s, first token at 10.4 s
        _ok("a/x", 10.1, ttft=350, e2e=800),  # behind the same unpark
        _ok("a/x", 20.0, ttft=40, e2e=90),  # warm: no unpark around it
        _ok("a/y", 10.0, ttft=400, e2e=900),  # another function's unpark is not its own
        _ok("a/x", 30.0, ttft=2000, e2e=2500, cold=True),  # cold: a bound event, not the unpark, decides
    ]
    events = [
        BoundEvent(10.2, "a/x", "unparked", None),
        BoundEvent(31.0, "a/x", "standby", 12.0),
        BoundEvent(29.5, "a/x", "unparked", None),  # around the cold request: it stays cold-path
    ]
    assign_paths(results, events)
    assert [r.path for r in results] == ["unparked", "unparked", "warm", "warm", "standby"]
    assert summarize(results, 2500.0)["paths"] == {"warm": 2, "unparked": 2, "standby": 1}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c", "d"]),
            st.integers(0, 20),  # sent, s
            st.integers(0, 3000),  # TTFT, ms
            st.integers(0, 5000),  # E2E beyond TTFT, ms
            st.integers(1, 6),  # completion tokens
        ),
        max_size=30,
    )
)
def test_decoding_functions_equals_counting_every_span(reqs: list[tuple[str, int, int, int, int]]) -> None:
    """The merged-interval count equals the definition: distinct functions whose decode span holds the middle
    of the request's own decode, its own function always included."""
    results = [_ok(fn, float(sent), ttft, ttft + extra, tokens=n) for fn, sent, ttft, extra, n in reqs]
    spans = [
        (r.function, r.sent_s + r.ttft_ms / 1000, r.sent_s + r.e2e_ms / 1000)
        for r in results
        if r.e2e_ms > r.ttft_ms
    ]
    want = []
    for r in results:
        if r.tpot_ms is None:
            continue
        mid = r.sent_s + (r.ttft_ms + r.e2e_ms) / 2000
        want.append((r.index, r.function, len({fn for fn, a, b in spans if a <= mid < b} | {r.function})))
    got = [(r.index, r.function, n) for r, n in decoding_functions(results)]
    assert got == want
