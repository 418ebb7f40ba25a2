"""KV offload on the real engine (tiny CPU model, fp32, greedy): a sequence swapped out to host memory and
back yields exactly the tokens of one never preempted, and of one preempted by recompute."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from lorafn.runtime.kv_offload import OffloadConfig
from tests.integration.runtime.engine_helpers import engine_greedy, mixed_prompts, write_peft_adapter

MAX_NEW = 12
# the host link infinitely fast and the prefill slow: every preemption that fits the budget swaps (online
# requests too: the default swaps batch requests only)
ALWAYS_SWAP = OffloadConfig(host_link_bytes_per_s=1e30, prefill_s_per_token=1.0, min_priority=0)
BATCH_SWAP = OffloadConfig(host_link_bytes_per_s=1e30, prefill_s_per_token=1.0)
NEVER_SWAP = OffloadConfig(host_budget_bytes=0)


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ad") / "a"
    return write_peft_adapter(tiny_model_dir, out, r=8, lora_alpha=16, target_modules="all-linear", seed=3)


def engine(model: Path, adapter: Path, offload: OffloadConfig, **kw) -> Engine:
    return Engine(
        EngineConfig(model=model, adapter=adapter, device="cpu", dtype="float32", kv_offload=offload, **kw)
    )


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
def test_swapped_sequences_give_the_tokens_of_unpreempted_ones_and_of_recompute(
    tiny_model_dir: Path, adapter: Path, chunked: bool
) -> None:
    prompts = mixed_prompts(seed=1, lengths=(3, 40, 11, 26, 1, 19, 50, 7))
    # plenty of KV: nothing is preempted
    reference = engine_greedy(engine(tiny_model_dir, adapter, NEVER_SWAP), prompts, MAX_NEW)
    assert len({t for row in reference for t in row}) >= 8, reference  # varied: equality means something
    tight = dict(enable_chunked_prefill=chunked, max_num_batched_tokens=64, max_num_seqs=8, block_size=4)
    tight["num_kv_blocks"] = 20
    swapping = engine(tiny_model_dir, adapter, ALWAYS_SWAP, **tight)
    assert engine_greedy(swapping, prompts, MAX_NEW) == reference
    stats = swapping.kv_offload_stats()
    assert stats["kv_swaps_out"] > 0 and stats["kv_swaps_in"] == stats["kv_swaps_out"]
    assert stats["kv_swap_out_bytes"] == stats["kv_swap_in_bytes"] > 0
    assert stats["kv_host_bytes"] == 0 and not swapping._host_kv  # nothing left behind
    assert stats["kv_host_budget_bytes"] == 2 << 30  # the default budget, whole blocks of it
    recomputing = engine(tiny_model_dir, adapter, NEVER_SWAP, **tight)
    assert engine_greedy(recomputing, prompts, MAX_NEW) == reference
    assert recomputing.kv_offload_stats()["kv_recomputes"] > 0
    assert recomputing.kv_offload_stats()["kv_swaps_out"] == 0


def test_a_batch_request_preempted_by_online_work_is_swapped_and_answers_the_same(
    tiny_model_dir: Path, adapter: Path
) -> None:
    """Batch requests fill the cache; online ones arrive mid-way and preempt them (by swap): every batch
    request's tokens equal those of the same request run alone."""
    batch_prompts = mixed_prompts(seed=2, lengths=(30, 28, 25))
    online_prompts = mixed_prompts(seed=3, lengths=(20, 24))
    batch = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, priority=1)
    online = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = engine(tiny_model_dir, adapter, NEVER_SWAP)
    expected = [
        o.token_ids for o in alone.generate(batch_prompts + online_prompts, [batch] * 3 + [online] * 2)
    ]

    # 28 blocks of 4 = 112 positions: the three batch requests (~83 + 48 tokens) take nearly all of it
    e = engine(tiny_model_dir, adapter, BATCH_SWAP, block_size=4, num_kv_blocks=28, max_num_batched_tokens=64)
    ids = [e.add_request(p, batch) for p in batch_prompts]
    for _ in range(4):  # the batch requests prefill and decode a few tokens
        e.step()
    ids += [e.add_request(p, online) for p in online_prompts]
    outputs = {i: e.get_output(i) for i in ids}
    while e.has_unfinished():
        e.step()
    assert [outputs[i].token_ids for i in ids] == expected  # type: ignore[union-attr]
    stats = e.kv_offload_stats()
    assert stats["kv_swaps_out"] > 0, stats  # the online requests did preempt batch ones, by swap
    assert stats["kv_swaps_in"] == stats["kv_swaps_out"] and stats["kv_host_bytes"] == 0


def test_an_aborted_swapped_request_drops_its_host_copy(tiny_model_dir: Path, adapter: Path) -> None:
    e = engine(
        tiny_model_dir, adapter, ALWAYS_SWAP, block_size=4, num_kv_blocks=20, max_num_batched_tokens=64
    )
    batch = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, priority=1)
    ids = [e.add_request(p, batch) for p in mixed_prompts(seed=4, lengths=(30, 30))]
    e.step()
    e.add_request(mixed_prompts(seed=5, lengths=(30,))[0], SamplingParams(max_tokens=4, temperature=0.0))
    e.step()
    swapped = [i for i in ids if i in e._host_kv]
    assert swapped, "the online request meant to swap a batch request out"
    e.abort(swapped[0])
    assert swapped[0] not in e._host_kv and e.kv_offload_stats()["kv_host_bytes"] == 0
