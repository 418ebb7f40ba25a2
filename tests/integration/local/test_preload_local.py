"""Pre-loading on one machine, as real processes: `lorafn up` on CPU keeps a standby prepared for a function's
adapter shape, tells it to pre-load that function's adapter (it heartbeats `preloaded` and stays a standby,
serving nothing), and the function's first request goes to exactly that standby (it takes the request
itself; with `preload_claims: false` the controller binds it) and gets the same tokens as a fresh engine
built with the adapter."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.local.platform_helpers import SMALL_DEVICE, local_platform
from tests.integration.local.platform_helpers import wait_for as _wait
from tests.integration.local.platform_helpers import workers as _workers
from tests.integration.runtime.engine_helpers import write_peft_adapter

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.mark.parametrize("claims", [True, False], ids=["claims", "bind-only"])
def test_a_preloaded_standby_serves_the_first_request_like_a_fresh_worker(
    tiny_model_dir: Path, tmp_path: Path, claims: bool
) -> None:
    adapter = write_peft_adapter(
        tiny_model_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    config = SMALL_DEVICE + ("" if claims else "preload_claims: false\n")
    with local_platform(tmp_path, config, cold_start_timeout_s=60) as platform:
        state, r, up = platform.state, platform.redis, platform.up
        docs = [
            "apiVersion: lorafn.io/v1alpha1\nkind: Backbone\nmetadata: {name: tiny}\n"
            f"spec: {{model: {{uri: 'file://{tiny_model_dir}'}}, dtype: float32, "
            "warmPool: {minStandby: 1, maxStandby: 1}}\n",
            "apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\nmetadata: {name: fa, namespace: t}\n"
            f"spec: {{backbone: tiny, adapter: {{uri: 'file://{adapter}'}}, "
            "scaling: {keepAliveSeconds: 300}}\n",
        ]
        platform.apply(docs, [None, "key-a"], tmp_path)

        def preloaded() -> list[str]:
            return [
                w
                for w, h in _workers(r).items()
                if h.get("state") == "standby" and h.get("preloaded") == "t/fa"
            ]

        holder = _wait("a standby holding t/fa's adapter", preloaded, 180, up)[0]
        # it stays a standby and serves nothing: the function has no worker, its stream no consumer
        assert r.zcard("lorafn:fn:t/fa:workers") == 0

        import openai

        client = openai.OpenAI(
            base_url=f"{state['gateway_url']}/v1", api_key="key-a", max_retries=0, timeout=120
        )
        got = client.completions.create(model="t/fa", prompt=PROMPT, max_tokens=8, temperature=0)
        # the controller writes the cold start into the status on the round after the bound event: the
        # answer can come back first (seen in CI)
        _wait(
            "the cold start in the status", lambda: r.hget("lorafn:fn:t/fa:status", "last_cold_path"), 30, up
        )
        status = r.hgetall("lorafn:fn:t/fa:status")
        assert status.get("last_cold_path") == "standby", status
        assert status.get("last_cold_preloaded") == "1", status
        # with claims the standby took the request itself (the controller's bind, if one was sent in the
        # race, came to a worker already serving); without, it waited for the bind
        assert status.get("last_cold_claimed") == ("1" if claims else "0"), status
        bound = {w: h for w, h in _workers(r).items() if h.get("function") == "t/fa"}
        assert list(bound) == [holder], (holder, bound)  # the pre-loaded standby took it

        from lorafn.api.tokenizer import TextTokenizer
        from lorafn.runtime import Engine, EngineConfig, SamplingParams

        ids = TextTokenizer(tiny_model_dir).encode(PROMPT)
        fresh = Engine(EngineConfig(model=tiny_model_dir, adapter=adapter, num_kv_blocks=64))
        want = fresh.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))[0]
        base = Engine(EngineConfig(model=tiny_model_dir, num_kv_blocks=64))
        without = base.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))[0]
        assert want.token_ids != without.token_ids, (
            "the adapter must change the answer for this test to mean anything"
        )
        assert got.choices[0].text == want.text
    if not claims:  # the controller's bind line: a bind into the pre-loaded standby
        assert "adapter pre-loaded" in platform.log
