"""admission.prepare (pure): the worker's request body and the prompt length, with the function's limits
checked and its generation defaults applied; `bearer` reads the API key."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafn.api import GenerationDefaults
from lorafn.gateway import schemas
from lorafn.gateway.admission import SEED_MASK, FunctionInfo, bearer, prepare
from lorafn.gateway.errors import APIError
from lorafn.gateway.tokenizer import GatewayTokenizer
from lorafn.store.protocol import RequestBody, SamplingWire
from lorafn.store.registry import FunctionRecord

GEN = GenerationDefaults(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, stop=["\n\n"])


def _info(tokenizer: GatewayTokenizer | None, max_context: int = 64) -> FunctionInfo:
    return FunctionInfo(FunctionRecord("team-a/f", {}), GEN, tokenizer, max_context, fetched=0.0)


def _completion(**body: object) -> schemas.CompletionRequest:
    return schemas.CompletionRequest.model_validate({"model": "team-a/f", **body})


def test_defaults_come_from_the_function_and_the_seed_from_the_caller(tiny_model_dir: Path) -> None:
    tok = GatewayTokenizer(tiny_model_dir)
    req = _completion(prompt="hello there")
    body, n = prepare(_info(tok), req, req.prompt, None, max_tokens_limit=100, seed=1234)
    ids = tok.encode("hello there")
    assert n == len(ids)
    assert body == RequestBody(
        prompt_token_ids=ids,
        params=SamplingWire(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, stop=["\n\n"], seed=1234),
    )
    # what the worker decodes is what the gateway built (the wire round trip loses nothing)
    assert RequestBody.decode(body.encode()) == body


def test_request_fields_override_the_defaults(tiny_model_dir: Path) -> None:
    tok = GatewayTokenizer(tiny_model_dir)
    req = _completion(prompt="x", max_tokens=3, temperature=0, top_p=1, top_k=0, stop="END", seed=-1)
    body, _ = prepare(_info(tok), req, req.prompt, None, max_tokens_limit=100, seed=1234)
    assert body.params == SamplingWire(
        max_tokens=3, temperature=0.0, top_p=1.0, top_k=0, stop=["END"], seed=-1 & SEED_MASK
    )


def test_default_max_tokens_is_clipped_to_the_room_left(tiny_model_dir: Path) -> None:
    tok = GatewayTokenizer(tiny_model_dir)
    req = _completion(prompt="one two three")
    n = len(tok.encode("one two three"))
    body, _ = prepare(_info(tok, max_context=n + 2), req, req.prompt, None, max_tokens_limit=100, seed=0)
    assert body.params.max_tokens == 2
    body, _ = prepare(_info(tok), req, req.prompt, None, max_tokens_limit=4, seed=0)
    assert body.params.max_tokens == 4


def test_chat_is_rendered_with_the_template(tiny_model_dir: Path) -> None:
    tok = GatewayTokenizer(tiny_model_dir)
    req = schemas.ChatCompletionRequest.model_validate(
        {"model": "team-a/f", "messages": [{"role": "user", "content": "Hi"}]}
    )
    body, n = prepare(_info(tok, 4096), req, None, req.messages, max_tokens_limit=100, seed=0)
    _, ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert body.prompt_token_ids == ids and body.prompt is None and n == len(ids)


def test_without_a_tokenizer_text_is_sent_and_bytes_are_counted() -> None:
    req = _completion(prompt="héllo")
    body, n = prepare(_info(None), req, req.prompt, None, max_tokens_limit=100, seed=0)
    assert body.prompt == "héllo" and body.prompt_token_ids is None
    assert n == len("héllo".encode())


@pytest.mark.parametrize(
    ("body", "chat", "param", "code"),
    [
        ({"prompt": "word " * 80}, False, "prompt", "context_length_exceeded"),
        ({"prompt": "hi", "max_tokens": 63}, False, "max_tokens", "context_length_exceeded"),
        ({"prompt": "hi", "max_tokens": 11}, False, "max_tokens", "context_length_exceeded"),  # the limit
        ({"prompt": [1, 2, 10**6]}, False, "prompt", "invalid_value"),
        ({"prompt": ""}, False, "prompt", "invalid_value"),  # no tokenizer: nothing (with one: BOS)
        ({"messages": [{"role": "user", "content": "hi"}]}, True, "messages", "chat_unsupported"),
    ],
)
def test_limits_are_refused_naming_the_field(
    tiny_model_dir: Path, body: dict, chat: bool, param: str, code: str
) -> None:
    tokenizer_less = code == "chat_unsupported" or body.get("prompt") == ""
    tok = None if tokenizer_less else GatewayTokenizer(tiny_model_dir)
    if chat:
        req = schemas.ChatCompletionRequest.model_validate({"model": "team-a/f", **body})
        prompt, messages = None, req.messages
    else:
        req = _completion(**body)
        prompt, messages = req.prompt, None
    with pytest.raises(APIError) as err:
        prepare(_info(tok), req, prompt, messages, max_tokens_limit=10, seed=0)
    assert (err.value.status, err.value.param, err.value.code) == (400, param, code)


@pytest.mark.parametrize(
    ("header", "key"),
    [
        ("Bearer sk-1", "sk-1"),
        ("bearer   sk-1  ", "sk-1"),
        ("Basic sk-1", None),
        ("Bearer ", None),
        ("sk-1", None),
        (None, None),
    ],
)
def test_bearer(header: str | None, key: str | None) -> None:
    assert bearer(header) == key
