"""A standby engine (no adapter, zeroed LoRA buffers of a shape) bound to an adapter generates exactly what
an engine built with that adapter generates: padded ranks and absent projections add exact zeros."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from tests.integration.runtime.engine_helpers import write_peft_adapter

PROMPTS = [[1, 5, 9, 3, 7], [2, 4, 6], [11, 12, 13, 14, 15, 16, 17]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _tokens(engine: Engine) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize(
    ("targets", "r", "shape", "how"),
    [
        (["q_proj", "v_proj"], 4, "q_proj:4,v_proj:4", "copied"),  # the prepared shape exactly
        (
            ["q_proj", "v_proj"],
            4,
            "q_proj:8,k_proj:8,v_proj:8,o_proj:8",
            "copied",
        ),  # padded ranks, extra targets
        ("all-linear", 4, "q_proj:8,v_proj:8", "loaded"),  # does not fit: loaded fresh
    ],
)
def test_bound_standby_equals_an_engine_built_with_the_adapter(
    tiny_model_dir: Path, tmp_path: Path, targets, r: int, shape: str, how: str
) -> None:
    adapter = write_peft_adapter(
        tiny_model_dir, tmp_path / "a", r=r, lora_alpha=2 * r, target_modules=targets
    )
    want = _tokens(Engine(EngineConfig(model=tiny_model_dir, adapter=adapter, num_kv_blocks=64)))
    standby = Engine(EngineConfig(model=tiny_model_dir, lora_shape=shape, num_kv_blocks=64))
    assert standby.lora_shape_key == shape
    base = _tokens(standby)  # zero buffers: the base model's answer
    assert standby.bind_adapter(adapter).startswith(how)
    assert _tokens(standby) == want
    assert want != base, "the adapter must change the greedy answer for this test to mean anything"
    assert standby.reserved_bytes() > 0


def test_bind_refusals(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lora_shape"):
        EngineConfig(model=tiny_model_dir, adapter=tmp_path, lora_shape="q_proj:4")
    with pytest.raises(ValueError, match="shape"):
        Engine(EngineConfig(model=tiny_model_dir, lora_shape="q_proj:x", num_kv_blocks=8))
    standby = Engine(EngineConfig(model=tiny_model_dir, lora_shape="q_proj:4", num_kv_blocks=8))
    with pytest.raises(ValueError, match="adapter"):
        standby.bind_adapter(tmp_path / "missing")


def test_warm_up_leaves_the_standby_clean(tiny_model_dir: Path, tmp_path: Path) -> None:
    from lorafn.runtime.standby import warm_up

    adapter = write_peft_adapter(tiny_model_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"])
    want = _tokens(Engine(EngineConfig(model=tiny_model_dir, adapter=adapter, num_kv_blocks=64)))
    standby = Engine(EngineConfig(model=tiny_model_dir, lora_shape="q_proj:4", num_kv_blocks=8))  # 128 tokens
    assert warm_up(standby, max_prompt_tokens=512) > 0  # capped to what the KV budget holds
    assert not standby.has_unfinished()
    assert standby.scheduler.block_manager.num_free_blocks == 8  # every block back
    standby.bind_adapter(adapter)
    assert [o.token_ids for o in standby.generate(PROMPTS[:1], GREEDY)] == want[:1]
