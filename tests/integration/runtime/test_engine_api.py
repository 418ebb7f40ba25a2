"""The Engine's API on CPU: generate, add_request + step, stream, abort, stops, seeded sampling."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafn.runtime import Engine, EngineConfig, RequestOutput, SamplingParams, StreamDelta
from tests.integration.runtime.engine_helpers import mixed_prompts, write_hf_model


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    model = write_hf_model(tmp_path_factory.mktemp("api") / "m", tiny_model_dir, "llama")
    return Engine(EngineConfig(model=model, device="cpu", max_num_seqs=4, max_num_batched_tokens=32))


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_generate_text_and_tokens(engine: Engine) -> None:
    out = engine.generate("The capital of France is", GREEDY)
    assert isinstance(out[0], RequestOutput)
    assert len(out[0].token_ids) == 10 and out[0].finish_reason == "length"
    assert out[0].text == engine.tokenizer.decode(out[0].token_ids, skip_special_tokens=True)
    assert out[0].ttft_s is not None and out[0].ttft_s >= 0
    assert not engine.has_unfinished()


def test_stream_deltas_add_up(engine: Engine) -> None:
    deltas = list(engine.stream("Hello! How are you today?", GREEDY))
    assert all(isinstance(d, StreamDelta) for d in deltas)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    whole = engine.generate("Hello! How are you today?", GREEDY)[0]
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text


def test_requests_join_a_running_batch_and_abort(engine: Engine) -> None:
    prompts = mixed_prompts(lengths=(5, 30))
    alone = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    got: dict[str, list[int]] = {}

    def step() -> None:
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)

    first = engine.add_request(prompts[0], GREEDY)
    doomed = engine.add_request([7, 8, 9], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        step()
    second = engine.add_request(prompts[1], GREEDY)  # joins while the others run
    assert engine.abort(doomed) and not engine.abort(doomed)
    while engine.has_unfinished():
        step()
    assert [got[first], got[second]] == alone
    assert engine.get_output(first) is None  # finished requests are not kept


def test_step_outputs_match_generate(engine: Engine) -> None:
    prompts = mixed_prompts(lengths=(5, 30, 12))
    expected = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for d in engine.step():
            got[d.request_id] += d.token_ids
    assert [got[i] for i in ids] == expected


def test_stop_token_and_stop_string(engine: Engine) -> None:
    free = engine.generate("Once upon a time", GREEDY)[0]
    stop_id = free.token_ids[3]
    first_stop = free.token_ids.index(stop_id)
    out = engine.generate(
        "Once upon a time",
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first_stop + 1]
    text = free.text
    if len(text.strip()) >= 4:
        needle = text.strip()[1:3]
        out = engine.generate(
            "Once upon a time", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=[needle])
        )[0]
        assert out.finish_reason == "stop" and needle not in out.text and text.startswith(out.text)


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine: Engine) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([[5, 6, 7, 8]], params)[0].token_ids
    crowd = engine.generate(
        [[9] * 20, [5, 6, 7, 8], [11, 12]],
        [SamplingParams(max_tokens=5, temperature=1.0), params, SamplingParams(max_tokens=30)],
    )
    assert crowd[1].token_ids == alone
    other = engine.generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert other[0].token_ids != alone


def test_bad_requests_are_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([10**6])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([5] * (engine.scheduler.max_model_len + 1))
    rid = engine.add_request([5, 6], GREEDY, request_id="same")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([5, 6], GREEDY, request_id="same")
    engine.abort(rid)


def test_max_model_len_finishes_with_length(tiny_model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", max_model_len=12))
    out = engine.generate([[5] * 8], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_a_kv_budget_is_never_exceeded_scratch_block_included(tiny_model_dir: Path) -> None:
    # the controller grants a worker a KV budget and counts exactly that: the cache, with the scratch block
    # padded decode rows write into, must fit in it (found on the H100: 33 blocks of 8 MiB for 256 MiB)
    from lorafn.runtime.kv_cache import block_bytes

    probe = Engine(EngineConfig(model=tiny_model_dir, device="cpu", num_kv_blocks=1))
    per_block = block_bytes(probe.model_config, probe.config.block_size, probe.dtype)
    for budget in (2 * per_block, 10 * per_block, 10 * per_block + per_block // 2):
        engine = Engine(EngineConfig(model=tiny_model_dir, device="cpu", kv_cache_memory_bytes=budget))
        assert engine.runner.kv_cache.nbytes <= budget
        assert engine.runner.kv_cache.nbytes > budget - 2 * per_block  # and nothing more is left out
    with pytest.raises(ValueError, match="less than two KV blocks"):
        Engine(EngineConfig(model=tiny_model_dir, device="cpu", kv_cache_memory_bytes=per_block + 1))


def test_a_worker_asked_for_prefill_graphs_serves_on_a_cpu(tiny_model_dir: Path, monkeypatch) -> None:
    # LORAFN_PREFILL_GRAPH_TOKENS set for a deployment whose worker runs on a CPU: the engine the worker
    # builds takes the buckets (4096: larger than any chunk, accepted), captures nothing (graphs are CUDA's)
    # and answers as an engine without them
    from lorafn.runtime.worker import WorkerSettings, default_engine
    from tests.integration.runtime.engine_helpers import engine_greedy

    monkeypatch.setenv("LORAFN_PREFILL_GRAPH_TOKENS", "64, 16,4096")
    engine = default_engine(WorkerSettings(function="a/f", model=str(tiny_model_dir), device="cpu"), None)
    assert engine.config.prefill_graph_tokens == (16, 64, 4096)
    assert engine.runner.prefill_graphs is None and not engine.runner.graphs_pending
    plain = Engine(EngineConfig(model=tiny_model_dir, device="cpu"))
    prompts = [[5, 6, 7, 8], [9] * 30]
    assert engine_greedy(engine, prompts, 6) == engine_greedy(plain, prompts, 6)
