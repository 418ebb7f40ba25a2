"""Sampling: greedy, temperature, top-k, top-p against brute force; seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lorafn.runtime.sampling import filter_probs, make_generator, sample
from lorafn.runtime.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Brute force, in float64, per token id: temperature, then top-k, then top-p."""
    v = len(logits)
    scaled = [x / temperature for x in logits]
    order = sorted(range(v), key=lambda i: -scaled[i])
    keep = set(order[: top_k if top_k > 0 else v])
    m = max(scaled[i] for i in keep)
    weights = {i: math.exp(scaled[i] - m) for i in keep}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    if top_p < 1.0:
        kept, mass = set(), 0.0
        for i in order:
            if i not in probs:
                break
            kept.add(i)
            mass += probs[i]
            if mass >= top_p:
                break
        total = sum(probs[i] for i in kept)
        probs = {i: probs[i] / total for i in kept}
    return [probs.get(i, 0.0) for i in range(v)]


@st.composite
def distinct_logits(draw, max_vocab=40):
    v = draw(st.integers(2, max_vocab))
    # Well separated values: no ties, no mass exactly at the top-p boundary up to float error.
    base = draw(st.permutations(list(range(v))))
    scale = draw(st.floats(0.05, 2.0))
    return [b * scale for b in base]


@settings(max_examples=200, deadline=None)
@given(
    distinct_logits(),
    st.floats(0.2, 3.0),
    st.integers(0, 45),
    st.sampled_from([1.0, 0.95, 0.9, 0.7, 0.5, 0.3, 0.1, 1e-6]),
    st.sampled_from([1, 3, 8, 1024]),
)
def test_filtered_distribution_matches_brute_force(logits, temperature, top_k, top_p, num_candidates):
    # Skip cases whose cumulative mass lands within float32 error of top_p (either answer is right).
    topk_probs = sorted(reference_probs(logits, temperature, top_k, 1.0), reverse=True)
    assume(all(abs(sum(topk_probs[: i + 1]) - top_p) > 1e-5 for i in range(len(topk_probs))))
    # num_candidates small: exercises the topk path and the fall back to a full sort.
    probs_sorted, order = filter_probs(
        torch.tensor([logits]),
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
        num_candidates=num_candidates,
    )
    got = torch.zeros(len(logits), dtype=torch.float64)
    got[order[0]] = probs_sorted[0].double()
    want = torch.tensor(reference_probs(logits, temperature, top_k, top_p), dtype=torch.float64)
    # Same support, same values.
    assert torch.equal(got > 0, want > 0), (got, want)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_tokens_stay_in_the_kept_set(device):
    torch.manual_seed(0)
    logits = torch.randn(6, 100, device=device)
    params = [
        SamplingParams(top_k=1),
        SamplingParams(top_k=5, seed=1),
        SamplingParams(top_p=0.3, seed=2),
        SamplingParams(top_k=10, top_p=0.5, temperature=0.7, seed=3),
        SamplingParams(temperature=5.0, top_k=3),
        SamplingParams(top_p=1e-9),  # nucleus keeps at least the top token
    ]
    gens = [make_generator(p.seed, device) for p in params]
    for _ in range(50):
        tokens = sample(logits, params, gens)
        assert tokens.dtype == torch.int64 and tokens.device.type == device
        for row, p in enumerate(params):
            probs = reference_probs(logits[row].double().cpu().tolist(), p.temperature, p.top_k, p.top_p)
            assert probs[int(tokens[row])] > 0


def test_filter_probs_batch_mixes_rows_with_and_without_top_k():
    torch.manual_seed(5)
    logits = torch.randn(4, 60) * 3
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0])
    top_k = torch.tensor([0, 7, 0, 2])
    top_p = torch.tensor([0.8, 1.0, 0.6, 0.5])
    for num_candidates in (1, 5, 20, 60, 1024):
        probs, order = filter_probs(logits, temperature, top_k, top_p, num_candidates=num_candidates)
        for row in range(4):
            got = torch.zeros(60, dtype=torch.float64)
            got[order[row]] = probs[row].double()
            want = reference_probs(
                logits[row].double().tolist(), float(temperature[row]), int(top_k[row]), float(top_p[row])
            )
            assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_temperature_zero_ignores_filters(device):
    torch.manual_seed(1)
    logits = torch.randn(8, 64, device=device)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.1, seed=i) for i in range(8)]
    tokens = sample(logits, params, [make_generator(i) for i in range(8)])
    assert torch.equal(tokens, logits.argmax(-1))


def test_mixed_batch_greedy_rows_are_argmax():
    torch.manual_seed(2)
    logits = torch.randn(5, 30)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i) for i in range(5)]
    tokens = sample(logits, params, [make_generator(p.seed) for p in params])
    for i in range(0, 5, 2):
        assert int(tokens[i]) == int(logits[i].argmax())


def test_top_k_one_and_tiny_temperature_are_greedy():
    torch.manual_seed(3)
    logits = torch.randn(4, 50)
    params = [SamplingParams(top_k=1, seed=1), SamplingParams(temperature=1e-4, seed=2)] * 2
    for _ in range(20):
        tokens = sample(logits, params, [make_generator(p.seed) for p in params])
        assert torch.equal(tokens, logits.argmax(-1))


def _stream(rows_in: torch.Tensor, order: list[int], seeds: list[int], steps: int) -> dict[int, list[int]]:
    """Tokens per seed over ``steps`` calls with the rows in ``order`` (batch composition varies)."""
    gens = {s: make_generator(s) for s in seeds}
    out: dict[int, list[int]] = {s: [] for s in seeds}
    params = {s: SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=s) for s in seeds}
    for _ in range(steps):
        rows = torch.stack([rows_in[i] for i in order])
        tokens = sample(rows, [params[seeds[i]] for i in order], [gens[seeds[i]] for i in order])
        for pos, i in enumerate(order):
            out[seeds[i]].append(int(tokens[pos]))
    return out


def test_seeded_sampling_is_reproducible_regardless_of_batch_order_and_company():
    torch.manual_seed(4)
    logits = torch.randn(4, 200)
    seeds = [11, 22, 33, 44]
    a = _stream(logits, [0, 1, 2, 3], seeds, 30)
    b = _stream(logits, [3, 1, 0, 2], seeds, 30)
    assert a == b
    # Alone in the batch, or with an unseeded neighbour, a seeded request draws the same tokens.
    gen = make_generator(22)
    alone = []
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=22)
    for step in range(30):
        rows = torch.stack([logits[1], logits[0]]) if step % 2 else logits[1:2]
        ps = [params, SamplingParams()] if step % 2 else [params]
        gs = [gen, None] if step % 2 else [gen]
        alone.append(int(sample(rows, ps, gs)[0]))
    assert alone == a[22]
    # A different seed gives a different stream.
    assert a[11] != _stream(logits, [0], [12], 30)[12]


def test_unseeded_rows_work_and_vary():
    logits = torch.zeros(1, 1000)
    draws = {int(sample(logits, [SamplingParams()], [None])[0]) for _ in range(20)}
    assert len(draws) > 10


def test_chi_square_on_a_known_distribution_with_a_fixed_seed():
    # p = softmax(log p): drawing 20000 tokens must fit p (chi-square, 5 dof; deterministic seed).
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = torch.log(p).unsqueeze(0).repeat(500, 1)
    params = [SamplingParams(seed=1234)] * 500
    counts = torch.zeros(6)
    gens = [make_generator(1234 + i) for i in range(500)]
    for _ in range(40):
        tokens = sample(logits, params, gens)
        counts += torch.bincount(tokens, minlength=6).float()
    n = counts.sum()
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 99.9th percentile of chi-square with 5 dof


@pytest.mark.parametrize(
    ("top_k", "top_p", "expected"),
    [
        (0, 0.75, [0.4, 0.25, 0.15]),  # mass before the 4th token is 0.8 >= 0.75: dropped
        (2, 1.0, [0.4, 0.25]),
        (3, 0.6, [0.4, 0.25]),  # top-k first, then the nucleus of the renormalised top-3
    ],
)
def test_chi_square_with_filters_over_a_large_vocabulary(top_k, top_p, expected):
    # 2000 tokens (more than the topk candidates): six carry the mass, the tail ~2e-4 in all.
    p = torch.full((2000,), 1e-7)
    p[:6] = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = torch.log(p).unsqueeze(0).repeat(200, 1)
    gens = [make_generator(99 + i) for i in range(200)]
    params = [SamplingParams(top_k=top_k, top_p=top_p, seed=0)] * 200
    counts = torch.zeros(2000)
    for _ in range(40):
        counts += torch.bincount(sample(logits, params, gens), minlength=2000).float()
    kept = len(expected)
    assert counts[kept:].sum() == 0  # nothing outside the filtered set
    want = torch.tensor(expected) / sum(expected) * counts.sum()
    chi2 = float(((counts[:kept] - want) ** 2 / want).sum())
    assert chi2 < 13.9  # 99.9th percentile of chi-square with <= 2 dof


def test_temperature_flattens_and_sharpens():
    p = torch.tensor([0.7, 0.2, 0.1])
    logits = torch.log(p).unsqueeze(0).repeat(2000, 1)
    gens = [make_generator(i) for i in range(2000)]

    def top_share(temperature: float) -> float:
        tokens = sample(logits, [SamplingParams(temperature=temperature, seed=0)] * 2000, gens)
        return float((tokens == 0).float().mean())

    assert top_share(0.3) > 0.9
    assert 0.65 < top_share(1.0) < 0.75
    assert top_share(10.0) < 0.45


def test_shape_errors():
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros(2, 5), [SamplingParams()], [None])
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        sample(torch.zeros(5), [SamplingParams()], [None])


@pytest.mark.parametrize(
    ("field", "kw"),
    [
        ("max_tokens", dict(max_tokens=0)),
        ("temperature", dict(temperature=-0.1)),
        ("temperature", dict(temperature=float("nan"))),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("top_k", dict(top_k=-1)),
        ("seed", dict(seed="x")),
        ("stop", dict(stop=[""])),
        ("stop_token_ids", dict(stop_token_ids=[-1])),
        ("ignore_eos", dict(ignore_eos="no")),
    ],
)
def test_sampling_params_validation_names_the_field(field, kw):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 1.0, 1.0, 0, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.ignore_eos is False and not p.greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(temperature=0).greedy
