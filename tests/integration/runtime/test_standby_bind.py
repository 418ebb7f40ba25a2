"""A standby engine (no adapter, zeroed LoRA buffers of a shape) bound to an adapter generates exactly what
an engine built with that adapter generates: padded ranks and absent projections add exact zeros."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from tests.integration.runtime.engine_helpers import write_peft_adapter

PROMPTS = [[1, 5, 9, 3, 7], [2, 4, 6], [11, 12, 13, 14, 15, 16, 17]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _standby_settings() -> object:
    """What Standby reads of a worker's settings (lorafn.runtime.worker.WorkerSettings), for a CPU standby."""
    from types import SimpleNamespace

    return SimpleNamespace(
        backbone="tiny", gpu="cpu/0", heartbeat_s=1.0, heartbeat_ttl_s=5.0, shape=None, kv_budget_mib=None
    )


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


@pytest.mark.parametrize("blocks", [8, 64])  # 128 tokens: no mixed steps (too small); 1024: the mixed steps
def test_warm_up_leaves_the_standby_clean(tiny_model_dir: Path, tmp_path: Path, blocks: int) -> None:
    from lorafn.runtime.standby import warm_up

    adapter = write_peft_adapter(tiny_model_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"])
    want = _tokens(Engine(EngineConfig(model=tiny_model_dir, adapter=adapter, num_kv_blocks=64)))
    standby = Engine(EngineConfig(model=tiny_model_dir, lora_shape="q_proj:4", num_kv_blocks=blocks))
    # (the mixed steps run on a GPU by default; asked for here, so that they are checked on CPU too)
    assert warm_up(standby, max_prompt_tokens=512, mixed=True) > 0
    assert not standby.has_unfinished()
    assert standby.scheduler.block_manager.num_free_blocks == blocks  # every block back
    standby.bind_adapter(adapter)
    assert [o.token_ids for o in standby.generate(PROMPTS[:1], GREEDY)] == want[:1]


@pytest.mark.parametrize(
    ("other_targets", "other_r", "how"),
    [
        (["q_proj"], 2, "copied"),  # fits the buffers: copied over them (v_proj's buffers must end all zero)
        ("all-linear", 8, "loaded"),  # does not fit: loaded fresh, the old buffers zeroed first
    ],
)
def test_a_standby_that_preloaded_one_function_serves_another_exactly(
    tiny_model_dir: Path, tmp_path: Path, redis_server: str, other_targets, other_r: int, how: str
) -> None:
    """Isolation: a standby that pre-loaded F's adapter (and never served F) bound to G answers exactly what
    a fresh engine with G's adapter answers, and nothing of F's adapter stays in its buffers."""
    import uuid

    import torch

    from lorafn.runtime.standby import Standby
    from lorafn.store import Keys, Store
    from lorafn.store.registry import FunctionRecord, put_function

    f_dir = write_peft_adapter(
        tiny_model_dir, tmp_path / "f", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    g_dir = write_peft_adapter(
        tiny_model_dir,
        tmp_path / "g",
        r=other_r,
        lora_alpha=2 * other_r,
        target_modules=other_targets,
        seed=3,
    )
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    for name, adapter in (("t/f", f_dir), ("t/g", g_dir)):
        spec = {"backbone": "tiny", "adapter": {"uri": f"file://{adapter}"}}
        store.run(put_function(keys, FunctionRecord(name, spec, str(tiny_model_dir), str(adapter))))
    settings = _standby_settings()
    engine = Engine(EngineConfig(model=tiny_model_dir, lora_shape="q_proj:4,v_proj:4", num_kv_blocks=64))
    standby = Standby(store, keys, settings, engine, "w-iso")
    assert standby.preload("t/f") >= 0
    with_f = _tokens(engine)  # (the test looks; the standby itself never runs F's requests)
    assert with_f == _tokens(Engine(EngineConfig(model=tiny_model_dir, adapter=f_dir, num_kv_blocks=64)))
    old = engine.runner.lora
    _record, _ms = standby.bind("t/g")
    assert not standby.bound_preloaded
    want = _tokens(Engine(EngineConfig(model=tiny_model_dir, adapter=g_dir, num_kv_blocks=64)))
    assert _tokens(engine) == want and want != with_f
    for groups in old.layers:  # whichever way G came in, F's values are gone from these tensors
        for g in groups.values():
            if how == "loaded":
                assert not torch.any(g.a_cat)
            for proj, _off, _r, b in g.targets:
                if how == "loaded" or proj == "v_proj":
                    assert not torch.any(b), proj
    store.close()


def test_a_preloaded_bind_is_registration_only_and_a_changed_adapter_is_loaded_again(
    tiny_model_dir: Path, tmp_path: Path, redis_server: str
) -> None:
    import uuid

    from lorafn.runtime.standby import Standby
    from lorafn.store import Keys, Store
    from lorafn.store.registry import FunctionRecord, put_function

    f_dir = write_peft_adapter(
        tiny_model_dir, tmp_path / "f", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    store, keys = Store(redis_server), Keys(f"t{uuid.uuid4().hex[:8]}")
    spec = {"backbone": "tiny", "adapter": {"uri": f"file://{f_dir}"}}
    store.run(put_function(keys, FunctionRecord("t/f", spec, str(tiny_model_dir), str(f_dir))))
    settings = _standby_settings()
    want = _tokens(Engine(EngineConfig(model=tiny_model_dir, adapter=f_dir, num_kv_blocks=64)))
    for changed in (False, True):
        engine = Engine(EngineConfig(model=tiny_model_dir, lora_shape="q_proj:4,v_proj:4", num_kv_blocks=64))
        standby = Standby(store, keys, settings, engine, f"w-{changed}")
        standby.preload("t/f")
        assert standby.fields("standby")["preloaded"] == "t/f"
        if changed:  # the tenant replaced its adapter after the pre-load: the bind must not use the old copy
            import os

            cfg = f_dir / "adapter_config.json"
            os.utime(cfg, ns=(cfg.stat().st_atime_ns, cfg.stat().st_mtime_ns + 10**9))
        standby.bind("t/f")
        assert standby.bound_preloaded is (not changed)
        assert _tokens(engine) == want
    with pytest.raises(ValueError, match="not registered"):
        Standby(store, keys, settings, engine, "w-x").preload("t/missing")
    store.close()
