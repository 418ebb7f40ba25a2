"""responses: the OpenAI JSON bodies, the SSE chunk sequence and the native invoke body of one answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

from lorafn.gateway import schemas
from lorafn.gateway.admission import Job
from lorafn.gateway.errors import APIError
from lorafn.gateway.responses import completion_body, event_stream, usage
from lorafn.store.protocol import Done

JOB = Job("team-a/f", "rid1", "1-0", cold=True, prompt_tokens=5, t0=100.0, first_text_at=100.25)
DONE = Done(finish_reason="length", prompt_tokens=6, completion_tokens=3)


def test_usage_prefers_the_workers_count_and_falls_back_to_the_gateways() -> None:
    assert usage(JOB, DONE) == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}
    no_count = Done(finish_reason="stop", prompt_tokens=0, completion_tokens=2)
    assert usage(JOB, no_count) == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def test_completion_and_chat_bodies() -> None:
    body = completion_body(JOB, "hi", DONE, "completion", end=101.0)
    assert body["id"] == "cmpl-rid1" and body["object"] == "text_completion" and body["model"] == "team-a/f"
    assert body["choices"] == [{"index": 0, "text": "hi", "finish_reason": "length", "logprobs": None}]
    assert body["usage"] == usage(JOB, DONE)
    chat = completion_body(JOB, "hi", DONE, "chat", end=101.0)
    assert chat["id"] == "chatcmpl-rid1" and chat["object"] == "chat.completion"
    assert chat["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "finish_reason": "length",
            "logprobs": None,
        }
    ]


def test_invoke_body_reports_timing() -> None:
    body = schemas.InvokeResponse.model_validate(completion_body(JOB, "hi", DONE, "invoke", end=101.0))
    assert (body.id, body.function, body.text, body.finish_reason) == ("rid1", "team-a/f", "hi", "length")
    assert body.usage == schemas.Usage(**usage(JOB, DONE))
    assert body.timing == schemas.InvokeTiming(ttft_ms=250.0, total_ms=1000.0, cold_start=True)


async def _texts(
    items: list[tuple[str | None, Done | None]], error: APIError | None = None
) -> AsyncGenerator[tuple[str | None, Done | None], None]:
    for item in items:
        yield item
    if error is not None:
        raise error


def _events(response: object) -> list[object]:
    async def read() -> list[bytes]:
        return [chunk async for chunk in response.body_iterator]  # type: ignore[attr-defined]

    raw = b"".join(asyncio.run(read())).decode()
    assert raw.endswith("\n\n")
    out: list[object] = []
    for event in raw.split("\n\n")[:-1]:
        assert event.startswith("data: ")
        data = event.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_stream_sends_role_text_finish_usage_done() -> None:
    errors: list[APIError] = []
    response = event_stream(JOB, _texts([("a", None), ("b", None), ("", DONE)]), "chat", True, errors.append)
    assert (
        response.headers["x-lorafn-request-id"] == "rid1" and response.headers["x-lorafn-cold-start"] == "1"
    )
    events = _events(response)
    assert [e if e == "[DONE]" else e["choices"] for e in events] == [  # type: ignore[index]
        [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": None,
                "logprobs": None,
            }
        ],
        [{"index": 0, "delta": {"content": "a"}, "finish_reason": None, "logprobs": None}],
        [{"index": 0, "delta": {"content": "b"}, "finish_reason": None, "logprobs": None}],
        [{"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}],
        [],
        "[DONE]",
    ]
    assert events[4]["usage"] == usage(JOB, DONE)  # type: ignore[index]
    assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}  # type: ignore[index]
    assert not errors


def test_completion_stream_error_is_one_event_without_done() -> None:
    errors: list[APIError] = []
    boom = APIError(503, "gone", type="service_unavailable", code="restart_diverged")
    events = _events(event_stream(JOB, _texts([("a", None)], boom), "completion", False, errors.append))
    assert events[0]["choices"] == [  # type: ignore[index]
        {"index": 0, "text": "a", "finish_reason": None, "logprobs": None}
    ]
    assert events[0]["object"] == "text_completion"  # type: ignore[index]
    assert events[1] == boom.body()
    assert errors == [boom]
