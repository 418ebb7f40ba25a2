"""Errors in the OpenAI shape `{"error": {"message", "type", "param", "code"}}` (openai clients parse it)."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

_NAMED = re.compile(r"^([a-z_]+): ")


class APIError(Exception):
    """An HTTP error answer. `param` names the request field at fault (None when none is)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def sse(self) -> bytes:
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str, retry_after_s: int = 1) -> APIError:
    return APIError(
        503, message, type="service_unavailable", code=code, headers={"Retry-After": str(retry_after_s)}
    )


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # pydantic adds the union member's type name ("str", "list[int]") to locations: drop those
    tags = ("str", "int", "float", "bool", "list", "dict")
    parts = [p for p in parts if not ("[" in p or "-" in p or p in tags)]
    return ".".join(parts) or None


def from_validation_error(err: ValidationError) -> APIError:
    """The first problem of a pydantic error as a 400 naming its field."""
    problems = err.errors(include_url=False)
    # of a union's alternatives, the deepest location is the most specific complaint
    problems.sort(key=lambda p: -len((_param(tuple(p.get("loc", ()))) or "").split(".")))
    first = problems[0] if problems else {"loc": (), "msg": str(err), "type": "value_error"}
    param = _param(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    named = _NAMED.match(msg)
    if named and (param is None or "." not in param):
        param = named.group(1) if param is None else param  # model validators name the field first
    if first.get("type") == "missing":
        return bad_request(f"{param}: this field is required", param, code="missing_required_parameter")
    if first.get("type") == "extra_forbidden":
        return bad_request(f"{param}: unknown field", param, code="unknown_parameter")
    shown = first.get("input")
    got = "" if isinstance(shown, dict | list) or shown is None else f" (got {str(shown)[:80]!r})"
    more = f"; and {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
    return bad_request(f"{param or 'body'}: {msg}{got}{more}", param)
