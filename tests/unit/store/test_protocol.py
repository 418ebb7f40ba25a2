"""The wire protocol: what the gateway writes, the worker reads back exactly; malformed input is refused
with a ProtocolError naming the field."""

from __future__ import annotations

import json

import pytest

from lorafn.store.protocol import (
    Accepted,
    Delta,
    Done,
    Error,
    ProtocolError,
    RequestBody,
    Restart,
    SamplingWire,
    decode_events,
    encode_events,
)


def test_request_body_round_trip() -> None:
    body = RequestBody(prompt_token_ids=[1, 2, 3], params=SamplingWire(max_tokens=5, seed=7, stop=["\n"]))
    again = RequestBody.decode(body.encode())
    assert again == body
    assert "prompt" not in json.loads(body.encode())  # None fields are not sent


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('{"prompt": "x", "params": {"max_tokens": true}}', "body.params.max_tokens"),
        ('{"prompt": "x", "params": {"max_tokens": 0}}', "body.params.max_tokens"),
        ('{"prompt": "x", "params": {"stream": "yes"}}', "body.params.stream"),
        ('{"prompt": "x", "extra": 1}', "body.extra"),
        ('{"prompt": 3}', "body.prompt"),
        ('{"prompt_token_ids": ["a"]}', "body.prompt_token_ids.0"),
        ("{}", "neither prompt nor prompt_token_ids"),
        ("[1]", "body"),
        ("not json", "body"),
    ],
)
def test_request_body_refusals_name_the_field(raw: str, field: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        RequestBody.decode(raw)
    assert field in str(exc.value)


def test_missing_body_is_refused() -> None:
    with pytest.raises(ProtocolError, match="body: missing"):
        RequestBody.decode(None)


def test_events_round_trip() -> None:
    events = [
        Restart(worker="w2", reason="previous worker died"),
        Accepted(worker="w2"),
        Delta(text="Hi", tokens=1),
        Done(finish_reason="stop", prompt_tokens=3, completion_tokens=1),
    ]
    assert decode_events(encode_events(events)) == events
    assert decode_events(encode_events([Error(code="expired", message="late")]))[0].code == "expired"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('[{"type": "delta", "text": "x"}]', "e.0.delta.tokens"),
        ('[{"type": "nope"}]', "e.0"),
        (
            '[{"type": "done", "finish_reason": "stop", "prompt_tokens": -1, "completion_tokens": 0}]',
            "e.0.done",
        ),
        ('{"type": "accepted"}', "e"),
        ("", "e: missing"),
    ],
)
def test_event_refusals_name_the_field(raw: str, field: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        decode_events(raw)
    assert field in str(exc.value)
