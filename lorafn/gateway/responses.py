"""Response formatting: a relayed answer as an OpenAI completion or chat completion (JSON), as OpenAI
server-sent-event chunks, or as the native invoke body. No I/O beyond the given text iterator.

Kinds: "completion" (`text_completion`), "chat" (`chat.completion`, chunks `chat.completion.chunk`),
"invoke" (`InvokeResponse`; streamed as completion chunks with usage).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Literal

from fastapi.responses import JSONResponse, StreamingResponse

from lorafn.gateway import schemas
from lorafn.gateway.admission import Job
from lorafn.gateway.errors import APIError
from lorafn.store.protocol import Done

Kind = Literal["completion", "chat", "invoke"]


def usage(job: Job, done: Done) -> dict[str, int]:
    """Token counts; the prompt count the gateway made stands in when the worker reports none."""
    prompt = done.prompt_tokens or job.prompt_tokens
    completion = done.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def headers(job: Job) -> dict[str, str]:
    return {"x-lorafn-request-id": job.request_id, "x-lorafn-cold-start": "1" if job.cold else "0"}


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def completion_body(job: Job, text: str, done: Done, kind: Kind, end: float) -> dict[str, Any]:
    """The JSON body of a non-streamed answer; `end` (monotonic) is when it was complete."""
    if kind == "invoke":
        return schemas.InvokeResponse(
            id=job.request_id,
            function=job.function,
            text=text,
            finish_reason=done.finish_reason,
            usage=schemas.Usage(**usage(job, done)),
            timing=schemas.InvokeTiming(
                ttft_ms=None if job.first_text_at is None else (job.first_text_at - job.t0) * 1000,
                total_ms=(end - job.t0) * 1000,
                cold_start=job.cold,
            ),
        ).model_dump()
    created = int(time.time())
    if kind == "chat":
        return {
            "id": f"chatcmpl-{job.request_id}",
            "object": "chat.completion",
            "created": created,
            "model": job.function,
            "usage": usage(job, done),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": done.finish_reason,
                    "logprobs": None,
                }
            ],
        }
    return {
        "id": f"cmpl-{job.request_id}",
        "object": "text_completion",
        "created": created,
        "model": job.function,
        "usage": usage(job, done),
        "choices": [{"index": 0, "text": text, "finish_reason": done.finish_reason, "logprobs": None}],
    }


def json_response(job: Job, text: str, done: Done, kind: Kind) -> JSONResponse:
    return JSONResponse(completion_body(job, text, done, kind, time.monotonic()), headers=headers(job))


class Chunks:
    """The OpenAI chunks of one streamed answer (`chat` or completion; invoke streams completions)."""

    def __init__(self, job: Job, chat: bool) -> None:
        self.job, self.chat, self.created = job, chat, int(time.time())
        if chat:
            self.id, self.object = f"chatcmpl-{job.request_id}", "chat.completion.chunk"
        else:
            self.id, self.object = f"cmpl-{job.request_id}", "text_completion"

    def _wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.job.function,
            "choices": choices,
            **extra,
        }

    def role(self) -> dict[str, Any]:
        """Chat only: the first chunk, naming the assistant role (with empty content, as OpenAI sends)."""
        delta = {"role": "assistant", "content": ""}
        return self._wrap([{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}])

    def text(self, text: str | None, finish: str | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text else {}
            return self._wrap([{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}])
        return self._wrap([{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}])

    def usage(self, done: Done) -> dict[str, Any]:
        return self._wrap([], usage=usage(self.job, done))


def event_stream(
    job: Job,
    texts: AsyncGenerator[tuple[str | None, Done | None], None],
    kind: Kind,
    include_usage: bool,
    on_error: Callable[[APIError], None],
) -> StreamingResponse:
    """Server-sent events of the relayed `texts`: chunks, the finish chunk, usage if asked, `[DONE]`.
    An error after the stream began is one event `data: {"error": ...}`, without `[DONE]`."""
    chunks = Chunks(job, chat=kind == "chat")

    async def body() -> AsyncIterator[bytes]:
        if chunks.chat:
            yield sse(chunks.role())
        try:
            async with aclosing(texts):
                async for text, done in texts:
                    if done is None:
                        yield sse(chunks.text(text))
                        continue
                    yield sse(chunks.text(None, done.finish_reason))
                    if include_usage:
                        yield sse(chunks.usage(done))
                    yield b"data: [DONE]\n\n"
                    return
        except APIError as e:
            on_error(e)
            yield e.sse()

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={**headers(job), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
