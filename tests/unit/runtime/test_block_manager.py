"""BlockManager: exclusive blocks, exact accounting, slot mapping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafn.runtime.block_manager import BlockManager, blocks_for_tokens, slot_mapping, slot_of
from lorafn.runtime.sequence import Sequence


def seq(seq_id: str) -> Sequence:
    return Sequence(seq_id, [1])


def test_allocate_covers_positions_and_free_returns_everything():
    bm = BlockManager(num_blocks=5, block_size=4)
    a = seq("a")
    assert bm.can_allocate(a, 9) and bm.num_blocks_needed(a, 9) == 3
    assert bm.allocate(a, 9) == a.block_table and len(a.block_table) == 3
    assert bm.allocate(a, 12) == []  # already covered
    assert bm.num_free_blocks == 2 and bm.num_used_blocks == 3
    b = seq("b")
    assert not bm.can_allocate(b, 9)
    with pytest.raises(RuntimeError, match="cannot allocate"):
        bm.allocate(b, 9)
    assert b.block_table == [] and bm.num_free_blocks == 2  # a failed allocation changes nothing
    bm.allocate(b, 8)
    assert set(a.block_table).isdisjoint(b.block_table)
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    assert a.block_table == [] and bm.num_free_blocks == 5
    bm.check_invariants([])


def test_slot_mapping_follows_the_block_table():
    table = [7, 2, 5]
    assert slot_of(table, 0, 4) == 28
    assert slot_of(table, 5, 4) == 9
    assert slot_mapping(table, 3, 4, 4) == [31, 8, 9, 10]
    assert blocks_for_tokens(0, 4) == 0 and blocks_for_tokens(4, 4) == 1 and blocks_for_tokens(5, 4) == 2


def test_freeing_a_foreign_block_is_detected():
    bm = BlockManager(num_blocks=2, block_size=2)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 2)
    b.block_table = list(a.block_table)  # a bug elsewhere: b claims a's block
    with pytest.raises(AssertionError, match="two block tables"):
        bm.check_invariants([a, b])
    with pytest.raises(RuntimeError, match="owned by"):
        bm.free(b)


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 1)])
def test_validation(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 20),
    st.integers(1, 8),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40), st.booleans()), max_size=60),
)
def test_random_allocate_and_free_keep_exact_accounting(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    seqs = [seq(f"s{i}") for i in range(6)]
    for index, num_tokens, release in ops:
        s = seqs[index]
        if release:
            bm.free(s)
        elif bm.can_allocate(s, num_tokens):
            before = len(s.block_table)
            bm.allocate(s, num_tokens)
            assert len(s.block_table) == max(before, blocks_for_tokens(num_tokens, block_size))
        else:
            assert bm.num_blocks_needed(s, num_tokens) > bm.num_free_blocks
        bm.check_invariants(seqs)
        assert bm.num_free_blocks + sum(len(x.block_table) for x in seqs) == num_blocks
