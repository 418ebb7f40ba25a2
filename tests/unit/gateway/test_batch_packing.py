"""The batch runner's pure packing policy: predicted KV sizes, the learned output estimate, rolling waves
and whole-batch first-fit-decreasing packing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafn.gateway.batch_packing import (
    Item,
    next_wave,
    order_for_packing,
    output_estimate,
    pack_waves,
    packing_room,
    predicted_tokens,
)


def sizes(items: list[Item], expected: int | None = None, block: int = 16) -> dict[str, int]:
    return {it.key: predicted_tokens(it, expected, block) for it in items}


def test_predicted_tokens_rounds_prompt_plus_output_up_to_blocks() -> None:
    it = Item("a", prompt_tokens=20, max_tokens=100)
    assert predicted_tokens(it, None, 16) == 128  # 120 -> 8 blocks
    assert predicted_tokens(it, 12, 16) == 32  # the estimate, when lower than max_tokens
    assert predicted_tokens(it, 500, 16) == 128  # never more than max_tokens
    with pytest.raises(ValueError, match="block_size"):
        predicted_tokens(it, None, 0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        Item("b", 0, 4)


def test_output_estimate_needs_samples_and_takes_a_high_quantile() -> None:
    assert output_estimate([5] * 10) is None
    assert output_estimate(list(range(1, 101)), min_samples=32, quantile=0.9) == 90
    with pytest.raises(ValueError, match="quantile"):
        output_estimate([1], quantile=0)


def test_next_wave_fills_free_room_largest_first_and_respects_slots() -> None:
    items = [Item("s", 4, 4), Item("l", 100, 28), Item("m", 40, 8)]
    size = sizes(items)  # s: 16, l: 128, m: 48
    ordered = order_for_packing(items, size)
    assert [it.key for it in ordered] == ["l", "m", "s"]
    assert [it.key for it in next_wave(ordered, size, 180, 10, False)] == ["l", "m"]
    assert [it.key for it in next_wave(ordered, size, 70, 10, False)] == ["m", "s"]  # l skipped, first fit
    assert [it.key for it in next_wave(ordered, size, 1000, 1, False)] == ["l"]
    assert [it.key for it in next_wave(ordered, size, None, 2, False)] == ["l", "m"]  # no KV figure: slots
    assert next_wave(ordered, size, 10, 5, False) == []  # nothing fits while others run: wait
    assert [it.key for it in next_wave(ordered, size, 10, 5, True)] == ["l"]  # ... but never forever


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=60),
    st.integers(16, 2048),
    st.integers(1, 16),
)
def test_pack_waves_places_every_item_once_within_capacity(reqs, capacity, max_seqs) -> None:
    items = [Item(f"r{i}", p, m) for i, (p, m) in enumerate(reqs)]
    size = sizes(items)
    waves = pack_waves(items, size, capacity, max_seqs)
    placed = [it.key for w in waves for it in w]
    assert sorted(placed) == sorted(it.key for it in items) and len(placed) == len(set(placed))
    for w in waves:
        assert len(w) <= max_seqs
        assert sum(size[it.key] for it in w) <= capacity or len(w) == 1  # an oversized item goes alone
    # first fit decreasing uses at most 11/9 OPT + 1 bins by size; a simple lower bound checks it is sane
    lower = max(
        -(-sum(min(size[k], capacity) for k in size) // capacity),
        -(-len(items) // max_seqs),
    )
    assert len(waves) <= 2 * lower + 1


def test_pack_waves_pairs_large_and_small_requests() -> None:
    # 96 + 32 tokens fill a wave of 128 exactly: 4 waves for 4 of each is the optimum (1,024 tokens)
    items = [Item(f"s{i}", 20, 1) for i in range(4)] + [Item(f"l{i}", 90, 1) for i in range(4)]
    size = sizes(items)
    waves = pack_waves(items, size, 128, 8)
    assert len(waves) == 4
    assert all(sorted(size[it.key] for it in w) == [32, 96] for w in waves)


def test_packing_room_overcommits_within_the_host_budget() -> None:
    assert packing_room(1000, 10_000, 0.0) == 1000  # default: the KV budgets only
    assert packing_room(1000, 10_000, 0.5) == 1500
    assert packing_room(1000, 200, 0.5) == 1200  # no more than the host can take
    assert packing_room(1000, 0, 2.0) == 1000  # no host budget: nothing beyond the cache
    with pytest.raises(ValueError, match="overcommit"):
        packing_room(1000, 0, -0.1)
    with pytest.raises(ValueError, match="kv_tokens"):
        packing_room(-1, 0, 0.0)
