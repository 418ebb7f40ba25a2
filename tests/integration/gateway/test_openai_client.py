"""The official openai client against the gateway over real HTTP, with a real redis-server and a worker
running the serving loop (fake engine: the data plane is what is under test)."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import openai
import pytest

from lorafn.gateway.tokenizer import GatewayTokenizer
from lorafn.store import Keys, Store
from tests.integration.gateway.harness import expected_text, gateway, register, worker_thread

FN = "team-a/summarize"
KEY = "sk-a-0123456789"


@pytest.fixture
def setup(redis_server: str, tiny_model_dir: Path):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [KEY], model_dir=str(tiny_model_dir))
    register(store, keys, "team-b/translate", ["sk-b-9876543210"], model_dir=str(tiny_model_dir))
    with gateway(redis_server, prefix) as url, worker_thread(redis_server, prefix, FN):
        yield url, GatewayTokenizer(tiny_model_dir)


def _ids_key(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def test_completion(setup) -> None:
    url, tok = setup
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    out = client.completions.create(model=FN, prompt="Hello world", max_tokens=5)
    assert out.choices[0].text == expected_text(_ids_key(tok.encode("Hello world")), 5)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens == len(tok.encode("Hello world"))
    assert out.model == FN


def test_chat_uses_the_models_chat_template(setup) -> None:
    url, tok = setup
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(model=FN, messages=messages, max_tokens=4)
    _, ids = tok.encode_chat(messages)
    assert "<|start_header_id|>user<|end_header_id|>" in tok.render_chat(messages)
    assert out.choices[0].message.content == expected_text(_ids_key(ids), 4)
    assert out.choices[0].message.role == "assistant"


def test_streaming_completion_and_chat(setup) -> None:
    url, tok = setup
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    chunks = list(client.completions.create(model=FN, prompt="stream me", max_tokens=6, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(_ids_key(tok.encode("stream me")), 6)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(chunks) >= 6  # token by token

    messages = [{"role": "user", "content": "stream chat"}]
    stream = client.chat.completions.create(
        model=FN, messages=messages, max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(_ids_key(tok.encode_chat(messages)[1]), 3)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_raw_sse_ends_with_done(setup) -> None:
    url, _ = setup
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": FN, "prompt": "x", "max_tokens": 2, "stream": True},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_models_lists_only_what_the_key_opens(setup) -> None:
    url, _ = setup
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    assert [m.id for m in client.models.list()] == [FN]
    other = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-b-9876543210")
    assert [m.id for m in other.models.list()] == ["team-b/translate"]


def test_errors_are_parsed_by_the_client(setup) -> None:
    url, _ = setup
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=FN, prompt="x", temperature=3.5)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).completions.create(
            model=FN, prompt="x"
        )
    with pytest.raises(openai.PermissionDeniedError):
        client.completions.create(model="team-b/translate", prompt="x")


def test_native_invoke(setup) -> None:
    url, tok = setup
    r = httpx.post(
        f"{url}/v1/functions/team-a/summarize:invoke",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"prompt": "native", "max_tokens": 3},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == expected_text(_ids_key(tok.encode("native")), 3)
    assert body["function"] == FN
    assert body["timing"]["cold_start"] is False
    assert body["usage"]["completion_tokens"] == 3
