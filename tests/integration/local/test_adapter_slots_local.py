"""Adapter slots on one machine, as real processes (docs/runtime.md#adapter-slots, issue 13): `lorafn up` on
CPU with a Backbone that opts in (`adapterSlots: 2`). The first function's cold start gets a worker with
two slots; the second function of the same namespace joins that worker (the controller's bind to a bound
worker, path "join": no new process); a function of another namespace gets a process of its own. Every
answer equals a fresh engine built with that function's adapter."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from lorafn.api.tokenizer import TextTokenizer
from lorafn.runtime import Engine, EngineConfig, SamplingParams
from tests.integration.local.platform_helpers import SMALL_DEVICE, local_platform
from tests.integration.local.platform_helpers import wait_for as _wait
from tests.integration.local.platform_helpers import workers as _workers
from tests.integration.runtime.engine_helpers import write_peft_adapter

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox jumps over the lazy dog"
FUNCTIONS = {"t/fa": "key-a-0123456789", "t/fb": "key-b-0123456789", "u/fc": "key-c-0123456789"}


def test_functions_of_one_namespace_share_a_slot_worker(tiny_model_dir: Path, tmp_path: Path) -> None:
    adapters = {
        name: write_peft_adapter(
            tiny_model_dir,
            tmp_path / name.replace("/", "-"),
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            seed=seed,
        )
        for seed, name in enumerate(FUNCTIONS, start=21)
    }
    ids = TextTokenizer(tiny_model_dir).encode(PROMPT)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    want = {
        name: Engine(EngineConfig(model=tiny_model_dir, adapter=path, num_kv_blocks=64)).generate(
            [ids], greedy
        )[0]
        for name, path in adapters.items()
    }
    assert len({w.text for w in want.values()}) == 3, "each adapter must change the answer"
    with local_platform(tmp_path, SMALL_DEVICE, cold_start_timeout_s=90) as platform:
        state, r, up = platform.state, platform.redis, platform.up
        docs = [
            "apiVersion: lorafn.io/v1alpha1\nkind: Backbone\nmetadata: {name: tiny}\n"
            f"spec: {{model: {{uri: 'file://{tiny_model_dir}'}}, dtype: float32, adapterSlots: 2, "
            "warmPool: {minStandby: 0, maxStandby: 1}}\n"
        ]
        for name, path in adapters.items():
            namespace, _, short = name.partition("/")
            docs.append(
                f"apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\nmetadata: {{name: {short}, "
                f"namespace: {namespace}}}\nspec: {{backbone: tiny, adapter: {{uri: 'file://{path}'}}, "
                "scaling: {keepAliveSeconds: 300}}\n"
            )
        platform.apply(docs, [None, *FUNCTIONS.values()], tmp_path)

        def ask(name: str) -> str:
            client = openai.OpenAI(
                base_url=f"{state['gateway_url']}/v1", api_key=FUNCTIONS[name], max_retries=0, timeout=180
            )
            return (
                client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
                .choices[0]
                .text
            )

        assert ask("t/fa") == want["t/fa"].text
        first = _wait(
            "t/fa's worker heartbeating two slots",
            lambda: [
                w for w, h in _workers(r).items() if h.get("function") == "t/fa" and h.get("slots") == "2"
            ],
            60,
            up,
        )[0]
        assert ask("t/fb") == want["t/fb"].text
        _wait(
            "the join in t/fb's status",
            lambda: r.hget("lorafn:fn:t/fb:status", "last_cold_path") == "join",
            60,
            up,
        )
        serving = _workers(r)[first]
        assert serving.get("functions") == "t/fa,t/fb" and serving.get("free_slots") == "0", serving
        assert r.zrange("lorafn:fn:t/fb:workers", 0, -1) == [first]
        # another namespace never shares that process
        assert ask("u/fc") == want["u/fc"].text
        others = r.zrange("lorafn:fn:u/fc:workers", 0, -1)
        assert others and first not in others, others
        # both functions are still answered by the shared worker, each with its own adapter
        assert ask("t/fa") == want["t/fa"].text and ask("t/fb") == want["t/fb"].text
    assert "join" in platform.log
