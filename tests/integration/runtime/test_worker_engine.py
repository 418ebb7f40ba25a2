"""The serving loop with the real Engine (tiny random Llama, CPU): answers through Redis and the gateway
equal the Engine's own greedy output, for concurrent requests that join the running batch; also with
overlapped steps (the CUDA default), the engine built from the worker's settings (`LORAFN_OVERLAP_STEPS`)."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import openai
import pytest

from lorafn.runtime import Engine, EngineConfig, SamplingParams
from lorafn.runtime.worker import WorkerSettings, default_engine
from lorafn.store import Keys, Store
from tests.integration.gateway.harness import gateway, register, worker_thread

FN, KEY = "team-a/tiny", "sk-tiny-0123456789"
PROMPTS = ["The quick brown fox", "Hello", "one two three four five six seven", "lorafn"]


@pytest.mark.parametrize("overlap", [False, True], ids=["steps-one-at-a-time", "overlapped"])
def test_real_engine_behind_the_gateway(
    redis_server: str, tiny_model_dir: Path, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32")
    reference = Engine(config).generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [KEY], model_dir=str(tiny_model_dir))
    monkeypatch.setenv("LORAFN_OVERLAP_STEPS", str(overlap).lower())
    settings = WorkerSettings(function=FN, model=str(tiny_model_dir), device="cpu", dtype="float32")
    engine = default_engine(settings, None)
    assert engine.overlap_steps is overlap
    with gateway(redis_server, prefix) as url, worker_thread(redis_server, prefix, FN, engine=engine):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        results: dict[int, str] = {}
        usage: dict[int, tuple[int, int]] = {}

        def one(i: int) -> None:
            if i % 2:
                chunks = client.completions.create(
                    model=FN, prompt=PROMPTS[i], max_tokens=12, temperature=0, stream=True
                )
                results[i] = "".join(c.choices[0].text for c in chunks if c.choices)
            else:
                out = client.completions.create(model=FN, prompt=PROMPTS[i], max_tokens=12, temperature=0)
                results[i] = out.choices[0].text
                usage[i] = (out.usage.prompt_tokens, out.usage.completion_tokens)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert results == {i: r.text for i, r in enumerate(reference)}
    assert usage == {
        i: (len(r.prompt_token_ids), len(r.token_ids)) for i, r in enumerate(reference) if i % 2 == 0
    }
