"""Overlapped steps (EngineConfig.overlap_steps) on the real engine: a tiny CPU model (fp32) with a real PEFT
adapter. Step n is queued before step n-1's tokens are read back; its inputs take those tokens from the
device copy (`PendingTokens`). Whatever the mix of requests (prompts joining a running batch, chunked prefill,
greedy and seeded sampling, stop tokens and strings, `max_tokens` of 1, `max_model_len`, preemption by
recompute and by swap, an abort while its step is queued, adapter slots), every request gets the tokens, text
and finish reason it gets without overlap, its deltas add up to its output, and no KV block is left held.

A missing device copy cannot pass unseen: the host keeps `PENDING_TOKEN` (-1) at such a position, and an
embedding lookup of -1 raises (`drive` also checks that no output holds it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from lorafn.runtime.kv_offload import OffloadConfig
from lorafn.runtime.model_runner import ModelRunner
from tests.integration.runtime.engine_helpers import (
    Arrivals,
    drive,
    mixed_arrivals,
    mixed_prompts,
    write_peft_adapter,
)

ALWAYS_SWAP = OffloadConfig(host_link_bytes_per_s=1e30, prefill_s_per_token=1.0, min_priority=0)
NEVER_SWAP = OffloadConfig(host_budget_bytes=0)


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ad") / "a"
    return write_peft_adapter(tiny_model_dir, out, r=8, lora_alpha=16, target_modules="all-linear", seed=7)


def make(model: Path, adapter: Path | None, overlap: bool, **kw) -> Engine:
    return Engine(
        EngineConfig(model=model, adapter=adapter, device="cpu", dtype="float32", overlap_steps=overlap, **kw)
    )


def both(model: Path, adapter: Path | None, arrivals: Arrivals, **kw) -> tuple[dict, dict]:
    reference = drive(make(model, adapter, False, **kw), arrivals)
    return reference, drive(make(model, adapter, True, **kw), arrivals)


def free_run(model: Path, adapter: Path, prompt: list[int], n: int) -> tuple[list[int], str]:
    out = make(model, adapter, False).generate(
        [prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    )[0]
    return out.token_ids, out.text


def summary(got: dict) -> dict:
    return {rid: (g["tokens"], g["text"], g["reason"]) for rid, g in got.items()}


def test_a_mixed_trace_gives_the_outputs_of_steps_one_at_a_time(
    tiny_model_dir: Path, adapter: Path, monkeypatch
) -> None:
    prompts = mixed_prompts(seed=11, lengths=(3, 40, 11, 26, 1, 19, 50, 7, 33))
    tokens, text = free_run(tiny_model_dir, adapter, prompts[2], 12)
    stop = text.strip()[1:3] if len(text.strip()) >= 4 else None
    arrivals = mixed_arrivals(prompts, tokens[4], stop)
    filled = []
    real = ModelRunner._pending_fill

    def spy(self, chunks, pending):
        fill = real(self, chunks, pending)
        filled.append(fill is not None and len(chunks) > len(fill[0]))  # a step of others beside them
        return fill

    # 24 tokens a step: prompts are chunked, decodes share steps with prefill chunks (the eager path)
    reference = drive(make(tiny_model_dir, adapter, False, max_num_batched_tokens=24), arrivals)
    monkeypatch.setattr(ModelRunner, "_pending_fill", spy)
    overlapped = drive(make(tiny_model_dir, adapter, True, max_num_batched_tokens=24), arrivals)
    assert summary(overlapped) == summary(reference)
    assert reference["stop-token"]["reason"] == "stop" and reference["one-token"]["tokens"]
    if stop:
        assert reference["stop-string"]["reason"] == "stop" and stop not in reference["stop-string"]["text"]
    assert any(filled), "no step read a pending token beside other chunks"


def test_max_model_len_and_max_tokens_end_before_the_next_step_is_planned(tiny_model_dir: Path) -> None:
    # max_model_len 24: a 20-token prompt ends at 24 tokens ("length") whatever its max_tokens
    arrivals: Arrivals = {
        0: [
            ("full", [5] * 20, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)),
            ("short", [7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
        ]
    }
    reference, overlapped = both(tiny_model_dir, None, arrivals, max_model_len=24)
    assert summary(overlapped) == summary(reference)
    assert reference["full"]["reason"] == "length" and len(reference["full"]["tokens"]) == 4
    assert reference["short"]["reason"] == "length" and len(reference["short"]["tokens"]) == 3


@pytest.mark.parametrize("offload", [NEVER_SWAP, ALWAYS_SWAP], ids=["recompute", "swap"])
def test_preemption_under_a_small_cache_gives_the_same_outputs(
    tiny_model_dir: Path, adapter: Path, offload: OffloadConfig
) -> None:
    prompts = mixed_prompts(seed=2, lengths=(30, 12, 25, 9, 40))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    arrivals: Arrivals = {0: [(f"p{k}", p, params) for k, p in enumerate(prompts[:3])]}
    arrivals[3] = [(f"p{k}", p, params) for k, p in enumerate(prompts[3:], start=3)]
    kw = dict(block_size=4, num_kv_blocks=40, kv_offload=offload, max_num_batched_tokens=64)
    reference_engine, overlapped_engine = make(tiny_model_dir, adapter, False, **kw), None
    reference = drive(reference_engine, arrivals)
    overlapped_engine = make(tiny_model_dir, adapter, True, **kw)
    overlapped = drive(overlapped_engine, arrivals)
    assert summary(overlapped) == summary(reference)
    assert reference_engine.num_preemptions and overlapped_engine.num_preemptions
    if offload is ALWAYS_SWAP:
        assert overlapped_engine.offload.stats.swaps_out > 0 and overlapped_engine.offload.stats.swaps_in > 0


def test_an_abort_while_its_step_is_queued_drops_its_token(tiny_model_dir: Path, adapter: Path) -> None:
    prompts = mixed_prompts(seed=4, lengths=(10, 14))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = drive(make(tiny_model_dir, adapter, True), {0: [("kept", prompts[0], params)]})
    eng = make(tiny_model_dir, adapter, True)
    got = drive(eng, {0: [("kept", prompts[0], params), ("gone", prompts[1], params)]}, abort_at={3: "gone"})
    assert got["gone"]["reason"] == "abort"
    # calls 1 and 2 read back the prefill and the first decode; call 3's abort dropped the queued one's token
    assert len(got["gone"]["tokens"]) == 2 and got["gone"]["delta_tokens"] == got["gone"]["tokens"]
    assert summary({"kept": got["kept"]}) == summary(alone)


def test_an_engine_parks_and_resizes_with_a_step_still_queued(tiny_model_dir: Path, adapter: Path) -> None:
    prompts = mixed_prompts(seed=6, lengths=(8, 21))
    tokens, _ = free_run(tiny_model_dir, adapter, prompts[0], 8)
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[tokens[2]])
    eng = make(tiny_model_dir, adapter, True, num_kv_blocks=64)
    reference = make(tiny_model_dir, adapter, False, num_kv_blocks=64).generate(prompts, params)
    ids = [eng.add_request(p, params) for p in prompts]
    outputs = [eng.get_output(i) for i in ids]
    deltas: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(3):
        for d in eng.step():
            deltas[d.request_id] += d.token_ids
    queued = eng.num_queued_steps
    eng.resize_kv(80 * eng.kv_block_bytes)  # reads the queued step back first; its deltas come with the next
    assert queued == 1 and eng.num_queued_steps == 0
    while eng.has_unfinished():
        for d in eng.step():
            deltas[d.request_id] += d.token_ids
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    assert [deltas[i] for i in ids] == [o.token_ids for o in reference]
    # the stop token ended the first request one step before it was read back: its dropped row is queued
    eng.generate(prompts[:1], params)
    # idle (a worker parks an engine only when it has nothing unfinished) with that row still queued
    assert eng.num_queued_steps == 1 and not eng.has_unfinished()
    assert eng.park() > 0 and eng.parked and eng.num_queued_steps == 0


def test_adapter_slots_give_the_same_outputs(tiny_model_dir: Path, adapter: Path, tmp_path: Path) -> None:
    other = write_peft_adapter(
        tiny_model_dir, tmp_path / "b", r=4, lora_alpha=8, target_modules=["q_proj"], seed=9
    )
    prompts = mixed_prompts(seed=8, lengths=(6, 17, 4, 30))
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    outs = []
    for overlap in (False, True):
        eng = Engine(
            EngineConfig(
                model=tiny_model_dir,
                adapters=(adapter, other),
                adapter_slots=2,
                device="cpu",
                dtype="float32",
                overlap_steps=overlap,
            )
        )
        outs.append([o.token_ids for o in eng.generate(prompts, params, adapter_slots=[0, 1, 1, 0])])
    assert outs[0] == outs[1]


def test_overlap_is_on_for_cuda_only_by_default_and_checked(tiny_model_dir: Path) -> None:
    assert Engine(EngineConfig(model=tiny_model_dir, device="cpu")).overlap_steps is False
    with pytest.raises(ValueError, match="overlap_steps"):
        EngineConfig(model=tiny_model_dir, overlap_steps="yes")  # type: ignore[arg-type]


def test_an_id_reused_after_an_abort_while_its_step_is_queued_is_a_new_request(
    tiny_model_dir: Path, adapter: Path
) -> None:
    short, other, long = mixed_prompts(seed=5, lengths=(6, 9, 30))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = make(tiny_model_dir, adapter, False).generate([long], params)[0].token_ids
    eng = make(tiny_model_dir, adapter, True)
    eng.add_request(short, params, request_id="x")
    eng.add_request(other, params, request_id="y")
    eng.step()
    eng.step()  # x's first decode is queued: its token sits at position 6, inside the new prompt's chunk
    assert eng.num_queued_steps == 1 and eng.abort("x")
    eng.add_request(long, params, request_id="x")
    out = eng.get_output("x")
    while eng.has_unfinished():
        eng.step()
    assert out.token_ids == alone


@pytest.mark.parametrize("overlap", [False, True], ids=["steps-one-at-a-time", "overlapped"])
def test_last_read_step_names_the_step_whose_wait_the_call_was(
    tiny_model_dir: Path, adapter: Path, overlap: bool
) -> None:
    """The worker's latency profile times each `step()` call: overlapped, that time is the wait for the step
    read back, one call behind `last_step` (the prefill step's kind goes with the next call's time)."""
    eng = make(tiny_model_dir, adapter, overlap)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng.add_request([5, 6, 7, 8, 9], params)
    launched, read = [], []
    while eng.has_unfinished():
        eng.step()
        launched.append(eng.last_step)
        read.append(eng.last_read_step)
    if overlap:
        assert read == [None, *launched[:-1]] and launched == [(1, 0), (0, 1), (0, 1), (0, 0)]
    else:
        assert read == launched == [(1, 0), (0, 1), (0, 1)]
