"""Parking the Engine on CPU (tiny random Llama): park releases the KV cache (nothing keeps the tensor
alive), refuses while a request is unfinished, and after unpark greedy outputs equal those before the park
(docs/runtime.md#parking)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from lorafn.runtime.outputs import ParkRefused

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# one long prompt (chunked over several steps under a 32-token budget) and short ones
PROMPTS = ["one two three four five six seven eight nine ten " * 4, "Hello", "The quick brown fox"]


@pytest.fixture
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(
        EngineConfig(
            model=tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32
        )
    )


def test_park_releases_the_kv_cache_and_unpark_gives_the_same_tokens(engine: Engine) -> None:
    before = engine.generate(PROMPTS, GREEDY)
    kv_bytes = engine.runner.kv_cache.nbytes
    assert engine.park_release_bytes() == kv_bytes  # on CPU: what parking frees is the KV cache
    kv_tensor = weakref.ref(engine.runner.kv_cache.data)
    num_blocks = engine.scheduler.block_manager.num_blocks

    assert engine.park() == kv_bytes
    gc.collect()
    assert kv_tensor() is None, "something still holds the parked KV cache"
    assert engine.parked and engine.runner.memory_parts()[0] == 0
    assert engine.park_release_bytes() == kv_bytes  # what unparking takes back
    assert engine.park() == kv_bytes  # idempotent: the same answer, nothing more released
    with pytest.raises(RuntimeError, match="parked"):
        engine.add_request("while parked", GREEDY)

    assert engine.unpark() == kv_bytes
    assert not engine.parked and engine.runner.kv_cache.num_blocks == num_blocks
    assert engine.scheduler.block_manager.num_free_blocks == num_blocks
    assert engine.unpark() == kv_bytes  # an unparked engine stays as it is
    after = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert [o.text for o in after] == [o.text for o in before]


def test_park_is_refused_while_a_request_is_unfinished(engine: Engine) -> None:
    rid = engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(ParkRefused, match="busy: 1 requests"):
        engine.park()
    engine.step()  # a first prefill chunk: the request holds KV blocks now
    with pytest.raises(ParkRefused, match=r"busy: 1 requests, \d+ KV blocks in use"):
        engine.park()
    assert not engine.parked and engine.get_output(rid) is not None
    while engine.has_unfinished():  # the refused park changed nothing: the request finishes
        engine.step()
    alone = Engine(engine.config).generate(PROMPTS[0], GREEDY)[0]
    assert engine.park() > 0 and engine.parked
    engine.unpark()
    assert engine.generate(PROMPTS[0], GREEDY)[0].token_ids == alone.token_ids


def test_an_aborted_request_leaves_the_engine_parkable(engine: Engine) -> None:
    rid = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    engine.abort(rid)
    assert engine.park() == engine.runner.parked_kv_bytes > 0


def test_park_drops_the_decode_graph_state_and_unpark_makes_it_again(engine: Engine) -> None:
    """The graph bookkeeping that runs on CUDA, exercised on CPU: a DecodeGraphRunner (static inputs, no
    capture: that needs CUDA) is released by park, so nothing keeps its tensors or the KV cache, and unpark
    builds a new one over the new cache with the same buckets, all pending."""
    from lorafn.runtime.cuda_graphs import DecodeGraphRunner

    runner = engine.runner
    runner.graphs = DecodeGraphRunner(runner.model, runner.kv_cache, [1, 2, 4], max_blocks_per_seq=8)
    runner.max_blocks_per_seq = 8
    statics = weakref.ref(runner.graphs.block_tables)
    kv_tensor = weakref.ref(runner.kv_cache.data)
    engine.park()
    gc.collect()
    assert runner.graphs is None and statics() is None and kv_tensor() is None
    engine.unpark()
    g = runner.graphs
    assert g is not None and g.kv_cache is runner.kv_cache and g.max_blocks == 8
    assert g.pending == list(g.buckets) and g.buckets == tuple(runner._buckets())
