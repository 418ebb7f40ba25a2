"""The typed wire protocol between the gateway and the workers: one definition, used by both sides.

`RequestBody` is the `body` field of a request-stream entry (see `lorafn.store.streams`); `ReplyEvent`
is one event of a reply stream. Both are strict: an unknown field, a wrong type (`max_tokens: true`) or
a missing required field is refused with `ProtocolError`, which names the field. A worker answers a
request whose body is refused with an `invalid_request` error event (and counts it); the gateway treats
a reply event it cannot parse as a worker error, never a crash.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

# Event types of a reply stream.
ACCEPTED, DELTA, RESTART, DONE, ERROR = "accepted", "delta", "restart", "done", "error"

# Request classes (`SamplingWire.priority`): online requests are admitted before batch ones.
PRIORITY_ONLINE, PRIORITY_BATCH = 0, 1


class ProtocolError(ValueError):
    """A stream entry that does not follow the protocol; the message names the offending field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class SamplingWire(_Strict):
    """The sampling parameters a request carries (the gateway resolved the function's defaults)."""

    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    # the request class: 0 online, 1 offline batch (admitted only into what online requests leave;
    # lorafn.runtime.scheduler.rank). Here rather than beside `params` so that the serving loop, which
    # hands `params` to the engine as they are, needs no change to carry it.
    priority: int = Field(default=PRIORITY_ONLINE, ge=PRIORITY_ONLINE, le=PRIORITY_BATCH)


class RequestBody(_Strict):
    """What a worker needs to run one request: the prompt (text or token ids) and its sampling."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingWire = Field(default_factory=SamplingWire)

    def model_post_init(self, _context: Any) -> None:
        if self.prompt is None and not self.prompt_token_ids:
            raise ValueError("the request has neither prompt nor prompt_token_ids")

    def encode(self) -> str:
        return self.model_dump_json(exclude_none=True)

    @classmethod
    def decode(cls, raw: str | bytes | None) -> RequestBody:
        """Parse a stream entry's `body`; ProtocolError naming the field on anything malformed."""
        if not raw:
            raise ProtocolError("body: missing")
        try:
            return cls.model_validate_json(raw)
        except ValidationError as e:
            raise ProtocolError(_describe(e, "body")) from None


class Accepted(_Strict):
    type: Literal["accepted"] = ACCEPTED
    worker: str


class Delta(_Strict):
    type: Literal["delta"] = DELTA
    text: str
    tokens: int = Field(ge=0)


class Restart(_Strict):
    type: Literal["restart"] = RESTART
    worker: str
    reason: str


class Done(_Strict):
    type: Literal["done"] = DONE
    finish_reason: str
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


class Error(_Strict):
    type: Literal["error"] = ERROR
    code: str
    message: str


ReplyEvent = Annotated[Accepted | Delta | Restart | Done | Error, Field(discriminator="type")]
_EVENTS: TypeAdapter[list[ReplyEvent]] = TypeAdapter(list[ReplyEvent])

# A reply event ends its request.
FINAL = (Done, Error)


def encode_events(events: list[ReplyEvent]) -> str:
    """The `e` field of one reply-stream entry: the events one engine step produced for a request."""
    return json.dumps([e.model_dump() for e in events], separators=(",", ":"))


def decode_events(raw: str | bytes | None) -> list[ReplyEvent]:
    """Parse an entry's `e` field; ProtocolError naming the field on anything malformed."""
    if not raw:
        raise ProtocolError("e: missing")
    try:
        return _EVENTS.validate_json(raw)
    except ValidationError as e:
        raise ProtocolError(_describe(e, "e")) from None


def _describe(error: ValidationError, root: str) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in (root, *first.get("loc", ())))
    return f"{where}: {first.get('msg', 'invalid')}"
