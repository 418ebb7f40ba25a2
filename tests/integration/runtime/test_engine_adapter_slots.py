"""CPU fp32: an engine with adapter slots serves the requests of several adapters in one batch, and every
request's greedy tokens equal transformers + peft with its own adapter (or the base model for an empty
slot), token for token, across mixed prefill/decode steps and chunked prefill."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from tests.integration.runtime.engine_helpers import (
    hf_greedy,
    mixed_prompts,
    write_peft_adapter,
)

MAX_NEW = 10


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three real PEFT adapters that fit one slot shape (r8 all-linear): two of that shape, one of a lower
    rank on q/v only (padded with zeros in its slot)."""
    root = tmp_path_factory.mktemp("adapters")
    kw = {"lora_alpha": 16, "target_modules": "all-linear"}
    return {
        "a": write_peft_adapter(llama_dir, root / "a", r=8, seed=1, **kw),
        "b": write_peft_adapter(llama_dir, root / "b", r=8, seed=2, **{**kw, "lora_alpha": 8}),
        "qv": write_peft_adapter(
            llama_dir, root / "qv", r=4, lora_alpha=12, target_modules=["q_proj", "v_proj"], seed=3
        ),
    }


@pytest.fixture(scope="module")
def references(llama_dir: Path, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    """Greedy tokens of every prompt under each adapter (and the base: None), from transformers + peft."""
    prompts = mixed_prompts()
    refs: dict[str | None, list[list[int]]] = {None: hf_greedy(llama_dir, None, prompts, MAX_NEW)}
    for name, path in adapters.items():
        refs[name] = hf_greedy(llama_dir, path, prompts, MAX_NEW)
    # the adapters must change the answers, or equality would not show each row kept to its own slot
    for name in adapters:
        assert refs[name] != refs[None], name
    assert refs["a"] != refs["b"]
    return refs


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _check(engine: Engine, slot_names: list[str | None], references) -> None:
    """Every prompt under every slot in one generate call (so each batch mixes the slots); each row's
    tokens against its own adapter's reference."""
    prompts = mixed_prompts()
    jobs = [(p, s) for p in range(len(prompts)) for s in range(len(slot_names))]
    outs = engine.generate([prompts[p] for p, _ in jobs], GREEDY, adapter_slots=[s for _, s in jobs])
    for (p, s), out in zip(jobs, outs, strict=True):
        assert out.token_ids == references[slot_names[s]][p], (p, slot_names[s])


@pytest.mark.parametrize("max_batched", [2048, 24])
def test_slots_match_peft_per_row(llama_dir: Path, adapters, references, max_batched: int) -> None:
    """Three adapters and an empty slot in one engine; 24 batched tokens: chunked prefill, steps that mix
    one slot's prefill chunk with other slots' decodes."""
    engine = Engine(
        EngineConfig(
            model=llama_dir,
            adapters=(adapters["a"], adapters["b"], adapters["qv"]),
            adapter_slots=4,
            device="cpu",
            dtype="float32",
            max_num_batched_tokens=max_batched,
        )
    )
    assert engine.num_adapter_slots == 4
    assert engine.lora_shape_key == engine.runner.lora.shape_key  # the first adapter's shape
    _check(engine, ["a", "b", "qv", None], references)


def test_load_adapter_swaps_one_slot(llama_dir: Path, adapters, references) -> None:
    """A slot is refilled or emptied while the others keep theirs; refused while its requests are queued."""
    engine = Engine(
        EngineConfig(
            model=llama_dir,
            adapters=(adapters["a"],),
            lora_shape="q_proj:8,k_proj:8,v_proj:8,o_proj:8,gate_proj:8,up_proj:8,down_proj:8",
            adapter_slots=2,
            device="cpu",
            dtype="float32",
        )
    )
    _check(engine, ["a", None], references)
    engine.load_adapter(1, adapters["qv"])
    _check(engine, ["a", "qv"], references)
    request = engine.add_request([5, 6, 7], GREEDY, adapter_slot=0)
    with pytest.raises(ValueError, match="adapter slot 0 has 1 requests"):
        engine.load_adapter(0, adapters["b"])
    engine.abort(request)
    engine.load_adapter(0, adapters["b"])
    engine.load_adapter(1, None)  # emptied: the base model
    _check(engine, ["b", None], references)


def test_slot_errors_name_the_problem(llama_dir: Path, adapters, tmp_path: Path) -> None:
    engine = Engine(
        EngineConfig(
            model=llama_dir, adapters=(adapters["a"],), adapter_slots=2, device="cpu", dtype="float32"
        )
    )
    with pytest.raises(ValueError, match=r"adapter_slot: 2 is not one of this engine's slots 0\.\.1"):
        engine.add_request([1, 2], adapter_slot=2)
    with pytest.raises(ValueError, match="adapter_slots: 1 given for 2 prompts"):
        engine.generate([[1, 2], [3]], adapter_slots=[0])
    with pytest.raises(ValueError, match="adapter slot: 5 is not one of the buffers' 2 slots"):
        engine.load_adapter(5, adapters["b"])
    with pytest.raises(ValueError, match=r"bind_adapter: an engine with adapter slots takes load_adapter"):
        engine.bind_adapter(adapters["b"])
    wide = write_peft_adapter(llama_dir, tmp_path / "wide", r=16, lora_alpha=16, target_modules="all-linear")
    with pytest.raises(ValueError, match="does not fit the buffers'"):
        engine.load_adapter(1, wide)
    with pytest.raises(ValueError, match=r"adapters\[1\]: .*wide.*does not fit the slots'"):
        Engine(
            EngineConfig(
                model=llama_dir,
                adapters=(adapters["qv"], wide),
                adapter_slots=2,
                device="cpu",
                dtype="float32",
            )
        )
    single = Engine(EngineConfig(model=llama_dir, adapter=adapters["a"], device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match="no adapter slots"):
        single.load_adapter(0, adapters["b"])
    with pytest.raises(ValueError, match=r"adapter_slot: 1 is not one of this engine's slots 0\.\.0"):
        single.add_request([1, 2], adapter_slot=1)


def test_bench_runs_on_cpu(tmp_path: Path) -> None:
    """bench/adapter_slots.py --tiny ends with a row per K (no timing asserted in tests)."""
    import json

    from bench.adapter_slots import main

    out = tmp_path / "slots.json"
    assert (
        main(["--tiny", "--slots", "1,2", "--decode-tokens", "2", "--repeats", "1", "--json", str(out)]) == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["k"] for r in rows] == [1, 2] and all(r["slots_s"] > 0 for r in rows)
