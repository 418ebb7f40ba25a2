"""Pure and small parts of the engine: CUDA-graph buckets and padding, KV-cache sizing and its saved
answer, the memory-mapped weight source, config parsing, EngineConfig validation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lorafn.runtime.config import EngineConfig, ModelConfig
from lorafn.runtime.cuda_graphs import (
    bucket_for,
    graph_buckets,
    pad_decode_inputs,
    pad_prefill_inputs,
    prefill_buckets,
)
from lorafn.runtime.kv_cache import (
    KVCache,
    block_bytes,
    blocks_for_budget,
    cpu_default_blocks,
    kv_init_key,
    load_kv_init,
    save_kv_init,
)
from lorafn.runtime.local_weights import SafetensorsWeightSource
from lorafn.runtime.weights import WeightSource

CFG = ModelConfig.from_dict(
    dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
)


@pytest.mark.parametrize("n,expected", [(1, 1), (2, 2), (3, 4), (8, 8), (9, 16), (64, 64), (65, None)])
def test_bucket_for(n: int, expected: int | None) -> None:
    assert bucket_for(n, (64, 1, 2, 4, 8, 16, 32)) == expected


@pytest.mark.parametrize(
    "max_batch,expected",
    [
        (64, [1, 2, 4, 8, 16, 32, 64]),
        (8, [1, 2, 4, 8]),
        (6, [1, 2, 4, 8]),
        (1, [1]),
        (100, [1, 2, 4, 8, 16, 32, 64]),
    ],
)
def test_graph_buckets_stop_at_the_largest_possible_batch(max_batch: int, expected: list[int]) -> None:
    # a KV budget of 8 blocks never runs more than 8 sequences: buckets above that only cost graph memory
    assert graph_buckets((64, 1, 2, 4, 8, 16, 32), max_batch) == expected
    with pytest.raises(ValueError, match="max_batch"):
        graph_buckets((1, 2), 0)


def test_pad_decode_inputs_pads_with_scratch() -> None:
    inputs = pad_decode_inputs(
        [5, 6, 7],
        [10, 0, 33],
        [42, 3, 81],
        [[2, 0], [0], [1, 3, 5]],
        bucket=4,
        max_blocks=4,
        scratch_block=9,
        block_size=16,
    )
    assert inputs.input_ids.tolist() == [5, 6, 7, 0]
    assert inputs.positions.tolist() == [10, 0, 33, 0]
    assert inputs.slot_mapping.tolist() == [42, 3, 81, 9 * 16]
    assert inputs.block_tables.tolist() == [[2, 0, 9, 9], [0, 9, 9, 9], [1, 3, 5, 9], [9, 9, 9, 9]]
    assert inputs.context_lens.tolist() == [11, 1, 34, 1]
    assert inputs.block_tables.dtype == np.int32
    with pytest.raises(ValueError, match="bucket"):
        pad_decode_inputs(
            [1] * 5, [0] * 5, [0] * 5, [[0]] * 5, bucket=4, max_blocks=4, scratch_block=9, block_size=16
        )


def test_pad_prefill_inputs_sends_the_padding_to_scratch() -> None:
    # a previous, longer replay's slots must not stay in the tail: its rows would write over that cache
    ids, slots = pad_prefill_inputs([5, 6, 7], [32, 33, 34], bucket=5, scratch_slot=144)
    assert ids.tolist() == [5, 6, 7, 0, 0] and ids.dtype == np.int64
    assert slots.tolist() == [32, 33, 34, 144, 144] and slots.dtype == np.int64
    with pytest.raises(ValueError, match="bucket 4"):
        pad_prefill_inputs([1] * 5, [0] * 5, bucket=4, scratch_slot=0)
    with pytest.raises(ValueError, match="2 KV slots for 3 tokens"):
        pad_prefill_inputs([1, 2, 3], [0, 1], bucket=4, scratch_slot=0)


@pytest.mark.parametrize(
    "max_chunk,expected",
    [(2048, [128, 256, 512]), (216, [128, 256]), (512, [128, 256, 512]), (100, [128]), (64, [128])],
)
def test_prefill_buckets_stop_at_the_first_that_holds_a_whole_chunk(
    max_chunk: int, expected: list[int]
) -> None:
    # the engine's chunk size, or its longest sequence if shorter (216: the H100 bench at prompt 200)
    assert prefill_buckets((512, 128, 256, 128), max_chunk) == expected
    assert prefill_buckets((), 512) == []


def test_prefill_graph_tokens_sorted() -> None:
    cfg = EngineConfig(model="/m", prefill_graph_tokens=(512, 64, 512), max_num_batched_tokens=512)
    assert cfg.prefill_graph_tokens == (64, 512)
    assert EngineConfig(model="/m").prefill_graph_tokens == ()  # off unless asked for
    # larger than a chunk: accepted (the runner leaves out what no chunk fills), so a worker whose setting
    # names one does not fail at start
    assert EngineConfig(model="/m", prefill_graph_tokens=(4096,)).prefill_graph_tokens == (4096,)


def test_kv_sizing() -> None:
    per = block_bytes(CFG, 16, torch.float32)
    assert per == 2 * 3 * 16 * 2 * 8 * 4
    assert blocks_for_budget(10 * per + 5, per) == 10
    assert cpu_default_blocks(4, 100, 16, per) == 4 * 7
    cache = KVCache(CFG, num_blocks=5, block_size=16, device=torch.device("cpu"), dtype=torch.float32)
    assert len(cache.layers) == 3 and cache.layers[0][0].shape == (6, 16, 2, 8)  # + the scratch block
    assert cache.scratch_slot == 5 * 16
    assert cache.layers[1][1].data_ptr() > cache.layers[0][0].data_ptr()  # views of one allocation


def test_kv_init_roundtrip(tmp_path: Path) -> None:
    fields = {"model": "/m", "dtype": "bf16", "device": "H100", "gpu_memory_utilization": 0.8}
    key = kv_init_key(fields)
    assert key == kv_init_key(dict(reversed(list(fields.items()))))
    assert key != kv_init_key({**fields, "gpu_memory_utilization": 0.9})
    assert load_kv_init(tmp_path, key) is None
    save_kv_init(tmp_path, key, 1234, fields)
    assert load_kv_init(tmp_path, key) == 1234
    (tmp_path / "kv_init" / f"{key}.json").write_text("{broken")
    assert load_kv_init(tmp_path, key) is None


def test_safetensors_source_hands_out_views(tmp_path: Path) -> None:
    a, b = torch.randn(4, 6), torch.arange(10, dtype=torch.bfloat16)
    save_file({"a": a, "b": b}, str(tmp_path / "model-00001.safetensors"))
    save_file({"c": torch.ones(3)}, str(tmp_path / "model-00002.safetensors"))
    src = SafetensorsWeightSource(tmp_path)
    assert isinstance(src, WeightSource)
    assert sorted(src.names()) == ["a", "b", "c"]
    got = src.get("a", "cpu", torch.float32)
    torch.testing.assert_close(got, a)
    # views into one file mapping: the same storage, no copy per tensor
    assert (
        got.untyped_storage().data_ptr() == src.get("b", "cpu", torch.bfloat16).untyped_storage().data_ptr()
    )
    assert src.get("a", "cpu", torch.float32).data_ptr() == got.data_ptr()
    assert src.get("b", "cpu", torch.float32).dtype == torch.float32  # a conversion is one copy
    with pytest.raises(KeyError, match="missing"):
        src.get("missing", "cpu", torch.float32)
    with pytest.raises(ValueError, match="safetensors"):
        SafetensorsWeightSource(tmp_path / "empty")


def test_model_config_parsing() -> None:
    llama3 = ModelConfig.from_dict(
        dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            vocab_size=64,
            rope_theta=500000.0,
            eos_token_id=[1, 9],
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    )
    assert llama3.rope_theta == 500000.0 and llama3.rope_scaling["rope_type"] == "llama3"
    assert llama3.num_kv_heads == 4 and llama3.head_dim == 8 and llama3.eos_token_ids == (1, 9)
    v5 = ModelConfig.from_dict(
        dict(
            model_type="qwen2",
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            vocab_size=64,
            sliding_window=4096,
            rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        )
    )
    assert v5.rope_theta == 1e6 and v5.rope_scaling is None and v5.sliding_window is None
    for bad, field in [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
    ]:
        raw = dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            vocab_size=64,
        )
        raw.update(bad)
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_dict(raw)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(dtype="float64"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(num_kv_blocks=4, kv_cache_memory_bytes=10), "num_kv_blocks"),
        (dict(block_size=0), "block_size"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(cuda_graph_batch_sizes=(0,)), "cuda_graph_batch_sizes"),
        (dict(prefill_graph_tokens=(1, 64)), "prefill_graph_tokens"),
    ],
)
def test_engine_config_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="/m", **kwargs)


def test_graph_runners_name_what_they_hold_and_drop_it_on_release() -> None:
    # what ModelRunner.park_release_bytes counts besides the pools: the static inputs and the outputs (none
    # before a capture); built on the CPU without capturing (only their buffers are looked at)
    from types import SimpleNamespace

    from lorafn.runtime.cuda_graphs import DecodeGraphRunner, PrefillGraphRunner

    cache = KVCache(CFG, num_blocks=4, block_size=16, device=torch.device("cpu"), dtype=torch.float32)
    model = SimpleNamespace(device=torch.device("cpu"))
    decode = DecodeGraphRunner(model, cache, buckets=(1, 4), max_blocks_per_seq=3)
    prefill = PrefillGraphRunner(model, cache, buckets=(8, 32))
    assert [tuple(t.shape) for t in decode.held_tensors()] == [(4,), (4,), (4,), (4, 3), (4,)]
    assert [tuple(t.shape) for t in prefill.held_tensors()] == [(32,), (32,), (32,), (1,)]
    assert prefill.slot_mapping.tolist() == [cache.scratch_slot] * 32  # padding writes go to scratch
    for runner in (decode, prefill):
        runner.release()
        assert runner.held_tensors() == [] and runner.kv_cache is None


def test_pending_rows_name_the_input_rows_whose_tokens_are_on_the_device() -> None:
    from lorafn.runtime.model_runner import pending_rows
    from lorafn.runtime.scheduler import ScheduledChunk
    from lorafn.runtime.sequence import Sequence

    def seq(sid: str, prompt: int, out: int) -> Sequence:
        return Sequence(sid, list(range(1, prompt + 1)), output_token_ids=[7] * out)

    a, b, c, d = seq("a", 5, 1), seq("b", 3, 2), seq("c", 9, 0), seq("d", 4, 1)
    chunks = [
        ScheduledChunk(a, 5, 1, True),  # a's decode: its input is position 5, pending in row 2
        ScheduledChunk(b, 4, 1, True),  # b's decode: position 4 is not the pending one (3 is)
        ScheduledChunk(c, 0, 6, False),  # a prefill chunk of 6 tokens: rows 2..7, no pending position
        ScheduledChunk(d, 0, 5, True),  # a recompute of d: its pending position 4 is its 5th row (row 12)
    ]
    where = {"a": (5, 2), "b": (3, 0), "d": (4, 1), "x": (0, 3)}
    assert pending_rows(chunks, where) == ([0, 12], [2, 1])
    assert pending_rows(chunks, {}) == ([], [])
