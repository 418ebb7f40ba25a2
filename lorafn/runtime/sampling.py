"""Token sampling for a batch: greedy, temperature, top-k, top-p; seeded per request.

One call samples one token per row. Greedy rows (temperature 0) take the argmax of the raw
logits. Other rows: logits / temperature, then top-k, then top-p (nucleus: the smallest set of
most likely tokens whose mass reaches p, always at least one token), then one draw.

The draw is by inverse CDF with ONE uniform number per row, taken from that row's own generator
(`make_generator(seed)`): a request's random stream does not depend on which other requests share
the batch or on their order, so the same seed gives the same tokens. The filtering and the CDF
search are vectorised over the batch; the uniforms come from CPU generators (no kernel launch per
row on GPU, and the same numbers on every device) and travel to the device in one small copy.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

import torch

from lorafn.runtime.sampling_params import SamplingParams

_shared_generator: torch.Generator | None = None


def make_generator(seed: int | None, device: torch.device | str | None = None) -> torch.Generator | None:
    """The generator of one request: seeded when ``seed`` is given, else None (shared stream).

    ``device`` is accepted for symmetry and ignored: draws are one uniform per row, taken on the
    CPU whatever the logits' device, which keeps seeded outputs identical across devices up to
    the logits themselves.
    """
    del device
    if seed is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


def _as_list(values: torch.Tensor | SequenceABC) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def filter_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor | SequenceABC[float],
    top_k: torch.Tensor | SequenceABC[int],
    top_p: torch.Tensor | SequenceABC[float],
    num_candidates: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Filtered distribution of each row over its candidate tokens, most likely first.

    logits [B, V] float; per row: temperature (> 0), top_k (0 = off), top_p (1 = off), as host
    lists (no device sync) or tensors. Returns (probs [B, K] float32: filtered-out candidates 0,
    rows sum to 1; order [B, K] int64: the token id of each column).

    Sorting the whole vocabulary is the slow part, so the candidates are a `topk`: K = max(top_k)
    when every row has a top-k; else K = max(max(top_k), num_candidates), which holds the nucleus
    of a row without top-k whenever those K tokens carry at least top_p of its mass (almost always
    for a trained model); when some row is not covered, K = V (a full sort).
    """
    temps, ks, ps = _as_list(temperature), [int(k) for k in _as_list(top_k)], _as_list(top_p)
    device = logits.device
    num_vocab = logits.shape[-1]
    all_k = all(k > 0 for k in ks)
    # Rows without top-k and without top-p need the whole vocabulary.
    full = not all_k and any(k == 0 and p >= 1.0 for k, p in zip(ks, ps, strict=True))
    width = min(max(ks), num_vocab) if all_k else min(num_vocab, max(max(ks), num_candidates))
    if full:
        width = num_vocab
    rows = [[t, k if k > 0 else num_vocab, p] for t, k, p in zip(temps, ks, ps, strict=True)]
    meta = torch.tensor(rows, dtype=torch.float32).to(device, non_blocking=True)
    temp_t, k_t, p_t = meta[:, 0:1], meta[:, 1:2], meta[:, 2:3]  # [B, 1] each
    scaled = logits.float() / temp_t
    if width < num_vocab:
        cand_logits, order = torch.topk(scaled, width, dim=-1, largest=True, sorted=True)
    else:
        cand_logits, order = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(width, device=device, dtype=torch.float32).unsqueeze(0)  # [1, K]
    cand_logits = cand_logits.masked_fill(ranks >= k_t, float("-inf"))
    # Rows with a top-k renormalise over it; rows without keep the whole vocabulary's normaliser,
    # so that their candidates' cumulative mass is the true one (what top-p is defined on).
    log_norm = torch.logsumexp(cand_logits, dim=-1, keepdim=True)
    if not all_k:
        has_k = k_t < num_vocab
        log_norm = torch.where(has_k, log_norm, torch.logsumexp(scaled, dim=-1, keepdim=True))
    probs = torch.exp(cand_logits - log_norm)
    if width < num_vocab and not all_k:
        # One device sync, only when rows without top-k use the topk shortcut: is it exact?
        covered = probs.sum(dim=-1, keepdim=True)
        if bool((~has_k & (covered < p_t + 1e-5)).any()):
            return filter_probs(logits, temps, ks, ps, num_candidates=num_vocab)
    if any(p < 1.0 for p in ps):
        # Nucleus: keep token i iff the mass strictly before it is < p (the first token stays).
        # Rows with p = 1 skip the test, so float rounding of the cumsum never drops their tail.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill((mass_before >= p_t) & (p_t < 1.0), 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, order


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column drawn per row: probs [n, K] (rows need not sum to 1), u [n, 1] in [0, 1) -> [n] int64.

    The first column whose cumulative mass exceeds u * total. Zero-mass columns never win (their
    cdf equals the previous one), and the target is kept strictly below the total so that the
    float rounding of u * total cannot run past the last column with mass.
    """
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:]
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum((u * total).to(cdf.dtype), below_total)
    col = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return col.clamp_(max=probs.shape[-1] - 1)


def _draw_uniforms(generators: SequenceABC[torch.Generator | None]) -> list[float]:
    """One uniform in [0, 1) per row, each from its row's generator (host floats)."""
    global _shared_generator
    values = []
    for generator in generators:
        if generator is None:
            if _shared_generator is None:
                _shared_generator = torch.Generator(device="cpu")
                _shared_generator.seed()
            generator = _shared_generator
        draw = torch.rand((), generator=generator, device=generator.device, dtype=torch.float64)
        values.append(draw.item())
    return values


def sample(
    logits: torch.Tensor,
    params: SequenceABC[SamplingParams],
    generators: SequenceABC[torch.Generator | None],
) -> torch.Tensor:
    """One token per row. logits [B, V] float32 (any device) -> token ids [B] int64 (same device).

    Rows are grouped by what they need, each group vectorised: greedy (argmax), plain
    temperature (softmax over the vocabulary, no sort), filtered (top-k and/or top-p over `topk`
    candidates, see `filter_probs`). Each row draws exactly one uniform from its own generator,
    whatever its group. Per group, the per-row values travel to the device in one small copy.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if len(params) != batch or len(generators) != batch:
        raise ValueError(
            f"logits has {batch} rows but {len(params)} params and {len(generators)} generators were given"
        )
    device = logits.device
    plain: list[int] = []
    filtered: list[int] = []
    for i, p in enumerate(params):
        if not p.greedy:
            (filtered if p.top_k > 0 or p.top_p < 1.0 else plain).append(i)
    if not plain and not filtered:
        return torch.argmax(logits, dim=-1)
    drawing = plain + filtered
    uniforms = dict(zip(drawing, _draw_uniforms([generators[i] for i in drawing]), strict=True))
    whole = len(plain) == batch or len(filtered) == batch
    tokens = None if whole else torch.argmax(logits, dim=-1)
    for rows, is_plain in ((plain, True), (filtered, False)):
        if not rows:
            continue
        if whole:
            sub = logits
        else:
            index = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
            sub = logits.index_select(0, index)
        u = torch.tensor([[uniforms[i]] for i in rows], dtype=torch.float64).to(device, non_blocking=True)
        if is_plain:
            temperature = torch.tensor([[params[i].temperature] for i in rows]).to(device, non_blocking=True)
            drawn = _inverse_cdf(torch.softmax(sub.float() / temperature, dim=-1), u)
        else:
            probs, order = filter_probs(
                sub,
                [params[i].temperature for i in rows],
                [params[i].top_k for i in rows],
                [params[i].top_p for i in rows],
            )
            drawn = order.gather(1, _inverse_cdf(probs, u).unsqueeze(1)).squeeze(1)
        if whole:
            return drawn
        tokens[index] = drawn  # type: ignore[index]
    return tokens  # type: ignore[return-value]
