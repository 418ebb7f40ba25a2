"""The OpenAI Files and Batch API (docs/batch.md): `POST /v1/files`, `GET /v1/files/{id}`,
`GET /v1/files/{id}/content`, `POST /v1/batches`, `GET /v1/batches/{id}`, `GET /v1/batches`,
`POST /v1/batches/{id}/cancel`.

Ownership: a file or batch belongs to the function whose API key created it; any other key gets 404 (as
for an id that does not exist, so ids cannot be probed). Batch creation validates every input line the
way an online request is validated (`admission.prepare`: the same limits, the gateway's tokenizer) and
writes the prepared requests next to the input; each bad line becomes an error-file line naming its
reason, the rest run (`batch_runner`).
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lorafn.api import FunctionRef
from lorafn.gateway import schemas
from lorafn.gateway.admission import FunctionInfo, bearer, prepare
from lorafn.gateway.batch_files import FileStore, new_id, parse_upload
from lorafn.gateway.deps import Gateway, gateway_of
from lorafn.gateway.errors import APIError, bad_request, from_validation_error
from lorafn.store import batches as bs
from lorafn.store import registry as reg

router = APIRouter()

ENDPOINTS: dict[str, str] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
_BODY_MODELS: dict[str, type[schemas.SamplingRequest]] = {
    "completion": schemas.CompletionRequest,
    "chat": schemas.ChatCompletionRequest,
}


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def _not_found(what: str, ident: str) -> APIError:
    return APIError(404, f"no {what} {ident!r} (for this API key)", type="not_found_error", code="not_found")


async def _owner(gw: Gateway, request: Request) -> str:
    """The function whose key the request carries (files and batches need a function's key)."""
    key = bearer(request.headers.get("authorization"))
    if not key:
        raise APIError(
            401,
            "missing API key (send Authorization: Bearer <key>)",
            type="authentication_error",
            code="missing_api_key",
        )
    salt = await gw.store.run(reg.ensure_salt(gw.keys))
    owner = await gw.store.run(reg.lookup_api_key(gw.keys, reg.hash_api_key(salt, key)))
    if owner is None:
        raise APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
    return str(owner)


def _file_object(rec: dict[str, str]) -> dict[str, Any]:
    return {
        "id": rec["id"],
        "object": "file",
        "bytes": int(rec.get("bytes") or 0),
        "created_at": int(rec.get("created_at") or 0),
        "filename": rec.get("filename") or "",
        "purpose": rec.get("purpose") or "batch",
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def _ts(rec: dict[str, str], field: str) -> int | None:
    value = rec.get(field)
    return int(float(value)) if value else None


def batch_object(rec: dict[str, str]) -> dict[str, Any]:
    """The OpenAI batch object of a batch record (`lorafn.store.batches`)."""
    errors = json.loads(rec["errors"]) if rec.get("errors") else None
    return {
        "id": rec["id"],
        "object": "batch",
        "endpoint": rec.get("endpoint", ""),
        "model": rec.get("function"),
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": rec.get("input_file_id", ""),
        "completion_window": rec.get("completion_window", "24h"),
        "status": rec.get("status", bs.IN_PROGRESS),
        "output_file_id": rec.get("output_file_id") or None,
        "error_file_id": rec.get("error_file_id") or None,
        **{
            f: _ts(rec, f)
            for f in (
                "created_at",
                "in_progress_at",
                "expires_at",
                "finalizing_at",
                "completed_at",
                "failed_at",
                "expired_at",
                "cancelling_at",
                "cancelled_at",
            )
        },
        "request_counts": {
            "total": int(rec.get("total") or 0),
            "completed": int(rec.get("completed") or 0),
            "failed": int(rec.get("failed") or 0),
        },
        "metadata": json.loads(rec["metadata"]) if rec.get("metadata") else None,
    }


async def _owned_file(gw: Gateway, owner: str, file_id: str) -> dict[str, str]:
    rec = await gw.store.run(bs.get_file(gw.keys, file_id)) if _plain_id(file_id) else {}
    if not rec or rec.get("function") != owner:
        raise _not_found("file", file_id)
    return rec


async def _owned_batch(gw: Gateway, owner: str, batch_id: str) -> dict[str, str]:
    rec = await gw.store.run(bs.get_batch(gw.keys, batch_id)) if _plain_id(batch_id) else {}
    if not rec or rec.get("function") != owner:
        raise _not_found("batch", batch_id)
    return rec


_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def _plain_id(value: str) -> bool:
    """An id the key schema can hold (ASCII only: str.isalnum() takes 'ÿ'); any other is simply unknown."""
    return bool(_ID.fullmatch(value))


def file_store(gw: Gateway) -> FileStore:
    return FileStore(gw.settings.file_store_dir())


# -- files ----------------------------------------------------------------------------------------
@router.post("/v1/files", summary="Upload a batch input file (multipart: purpose=batch, file=JSONL)")
async def create_file(request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    owner = await _owner(gw, request)
    s = gw.settings
    body = await request.body()  # BodyLimitMiddleware holds it to max_file_bytes (413 names the limit)
    fields, upload = await asyncio.to_thread(parse_upload, request.headers.get("content-type"), body)
    purpose = fields.get("purpose")
    if purpose != "batch":
        raise bad_request(f"purpose: only 'batch' is supported (got {purpose!r})", "purpose")
    if upload is None:
        raise bad_request(
            "file: this field is required (the JSONL of requests)", "file", code="missing_required_parameter"
        )
    filename, data = upload
    if len(data) > s.max_file_bytes:
        raise APIError(
            413,
            f"file: {len(data)} bytes, more than max_file_bytes ({s.max_file_bytes})",
            param="file",
            code="file_too_large",
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request(
            "file: not UTF-8 text (a batch file is JSONL)", "file", code="invalid_file"
        ) from None
    num_lines = sum(1 for line in text.splitlines() if line.strip())
    if num_lines == 0:
        raise bad_request("file: no request lines", "file", code="invalid_file")
    if num_lines > s.max_batch_requests:
        raise bad_request(
            f"file: {num_lines} lines, more than max_batch_requests ({s.max_batch_requests})",
            "file",
            code="too_many_requests",
        )
    file_id = new_id("file-")
    path = await asyncio.to_thread(file_store(gw).write, file_id, data)
    rec = {
        "purpose": "batch",
        "filename": filename[:255],
        "bytes": len(data),
        "created_at": int(time.time()),
        "path": str(path),
    }
    await gw.store.run(bs.put_file(gw.keys, owner, file_id, rec))
    return _file_object({**rec, "id": file_id, "function": owner})  # type: ignore[dict-item]


@router.get("/v1/files", summary="This key's function's files, newest first")
async def list_files(request: Request, limit: int = 100) -> dict[str, Any]:
    gw = gateway_of(request)
    owner = await _owner(gw, request)
    if not 1 <= limit <= 10_000:
        raise bad_request(f"limit: must be in [1, 10000] (got {limit})", "limit")
    ids = await gw.store.run(bs.list_file_ids(gw.keys, owner, limit))
    recs = [await gw.store.run(bs.get_file(gw.keys, i)) for i in ids]
    return {"object": "list", "data": [_file_object(r) for r in recs if r], "has_more": False}


@router.delete("/v1/files/{file_id}", summary="Delete a file (its record and its content)")
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    owner = await _owner(gw, request)
    rec = await _owned_file(gw, owner, file_id)
    await gw.store.run(bs.delete_file(gw.keys, owner, file_id))
    await asyncio.to_thread(file_store(gw).delete, rec["path"])
    return {"id": file_id, "object": "file", "deleted": True}


@router.get("/v1/files/{file_id}", summary="A file's object")
async def retrieve_file(file_id: str, request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    return _file_object(await _owned_file(gw, await _owner(gw, request), file_id))


@router.get("/v1/files/{file_id}/content", summary="A file's content (JSONL)", response_class=Response)
async def file_content(file_id: str, request: Request) -> Response:
    gw = gateway_of(request)
    rec = await _owned_file(gw, await _owner(gw, request), file_id)
    try:
        data = await asyncio.to_thread(file_store(gw).read, rec["path"])
    except OSError:
        raise _not_found("file content", file_id) from None
    return Response(data, media_type="application/jsonl")


# -- batches --------------------------------------------------------------------------------------
@dataclass
class Validated:
    """The outcome of validating an input file: prepared request lines and error lines."""

    prepared: list[dict[str, Any]]
    errors: dict[str, str]  # custom_id or `#<line>` -> error-file line
    total: int


def error_line(custom_id: str | None, code: str, message: str) -> str:
    """One error-file line, in the OpenAI shape."""
    return json.dumps(
        {
            "id": f"batch_req_{secrets.token_hex(12)}",
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        },
        separators=(",", ":"),
    )


def validate_lines(
    info: FunctionInfo, endpoint: str, text: str, max_tokens_limit: int, max_bytes_per_token: int
) -> Validated:
    """Each line: JSON object with a unique `custom_id`, `method` POST, `url` = the batch's endpoint,
    `body` an OpenAI request for this key's function (`model`) that passes the online checks
    (`admission.prepare`). CPU-bound (tokenizing): called in a thread."""
    kind = ENDPOINTS[endpoint]
    model_type = _BODY_MODELS[kind]
    function = info.record.function
    prepared: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    seen: set[str] = set()
    total = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        total += 1

        def fail(
            custom_id: str | None, code: str, message: str, key: str | None = None, number: int = number
        ) -> None:
            errors[key or custom_id or f"#{number}"] = error_line(
                custom_id, code, f"line {number}: {message}"
            )

        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            fail(None, "invalid_json", "not valid JSON")
            continue
        if not isinstance(obj, dict):
            fail(None, "invalid_json", "a line must be a JSON object")
            continue
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
            fail(None, "missing_custom_id", "custom_id: required, a string of 1-512 characters")
            continue
        if custom_id in seen:
            fail(
                custom_id,
                "duplicate_custom_id",
                f"custom_id {custom_id!r} appears on an earlier line",
                key=f"#{number}",
            )
            continue
        seen.add(custom_id)
        if obj.get("method", "POST") != "POST":
            fail(custom_id, "invalid_method", f"method: must be POST (got {obj.get('method')!r})")
            continue
        if obj.get("url", endpoint) != endpoint:
            fail(
                custom_id,
                "invalid_url",
                f"url: must be the batch's endpoint {endpoint} (got {obj.get('url')!r})",
            )
            continue
        body = obj.get("body")
        if not isinstance(body, dict):
            fail(custom_id, "invalid_body", "body: required, a JSON object")
            continue
        model = body.get("model")
        try:
            named = str(FunctionRef.parse(model)) if isinstance(model, str) else None
        except ValueError:
            named = None
        if named != function:
            fail(
                custom_id, "model_mismatch", f"body.model: {model!r} is not this key's function {function!r}"
            )
            continue
        if body.get("stream"):
            fail(custom_id, "invalid_body", "body.stream: a batch request cannot stream")
            continue
        try:
            req = model_type.model_validate(body)
            prompt = getattr(req, "prompt", None)
            messages = getattr(req, "messages", None)
            wire, num_prompt = prepare(
                info,
                req,
                prompt,
                messages,
                max_tokens_limit=max_tokens_limit,
                seed=secrets.randbits(63),
                max_bytes_per_token=max_bytes_per_token,
            )
        except ValidationError as e:
            err = from_validation_error(e)
            fail(custom_id, "invalid_body", f"body.{err.message}")
            continue
        except APIError as e:
            fail(custom_id, e.code or "invalid_body", f"body.{e.message}")
            continue
        params = wire.params.model_copy(update={"priority": 1})  # protocol.PRIORITY_BATCH
        wire = wire.model_copy(update={"params": params})
        prepared.append(
            {
                "custom_id": custom_id,
                "line": number,
                "kind": kind,
                "prompt_tokens": num_prompt,
                "body": json.loads(wire.encode()),
            }
        )
    return Validated(prepared, errors, total)


@router.post("/v1/batches", summary="Create a batch over an uploaded input file")
async def create_batch(request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    owner = await _owner(gw, request)
    try:
        raw = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise bad_request("the body is not valid JSON", None, code="invalid_json") from None
    if not isinstance(raw, dict):
        raise bad_request("the body must be a JSON object", None, code="invalid_json")
    try:
        req = BatchCreate.model_validate(raw)
    except ValidationError as e:
        raise from_validation_error(e) from None
    if req.endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint: one of {sorted(ENDPOINTS)} (got {req.endpoint!r})", "endpoint")
    if req.completion_window != "24h":
        raise bad_request(
            f"completion_window: only '24h' is supported (got {req.completion_window!r})", "completion_window"
        )
    file_rec = await _owned_file(gw, owner, req.input_file_id)
    if file_rec.get("purpose") != "batch":
        raise bad_request(f"input_file_id: {req.input_file_id!r} is not a batch input file", "input_file_id")
    info = await gw.admitter.authorize(bearer(request.headers.get("authorization")), owner)
    store = file_store(gw)
    try:
        text = (await asyncio.to_thread(store.read, file_rec["path"])).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        raise bad_request(
            f"input_file_id: the content of {req.input_file_id!r} is unreadable", "input_file_id"
        ) from None
    s = gw.settings
    checked = await asyncio.to_thread(
        validate_lines, info, req.endpoint, text, s.max_tokens_limit, s.max_prompt_bytes_per_token
    )
    batch_id = new_id("batch_")
    lines = "".join(json.dumps(p, separators=(",", ":")) + "\n" for p in checked.prepared)
    path = await asyncio.to_thread(store.write, f"{batch_id}.requests.jsonl", lines.encode())
    now = int(time.time())
    record = {
        "endpoint": req.endpoint,
        "input_file_id": req.input_file_id,
        "completion_window": req.completion_window,
        "status": bs.IN_PROGRESS,
        "created_at": now,
        "in_progress_at": now,
        "expires_at": now + 24 * 3600,
        "total": checked.total,
        "completed": 0,
        "failed": len(checked.errors),
        "metadata": json.dumps(req.metadata) if req.metadata else "",
        "requests_path": str(path),
    }
    await gw.store.run(bs.create_batch(gw.keys, owner, batch_id, record, errors=checked.errors))
    return batch_object({**{k: str(v) for k, v in record.items()}, "id": batch_id, "function": owner})


@router.get("/v1/batches/{batch_id}", summary="A batch's object (status, request_counts, files)")
async def retrieve_batch(batch_id: str, request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    return batch_object(await _owned_batch(gw, await _owner(gw, request), batch_id))


@router.get("/v1/batches", summary="This key's function's batches, newest first")
async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict[str, Any]:
    gw = gateway_of(request)
    owner = await _owner(gw, request)
    if not 1 <= limit <= 100:
        raise bad_request(f"limit: must be in [1, 100] (got {limit})", "limit")
    ids = await gw.store.run(bs.list_batch_ids(gw.keys, owner, limit + 1, after))
    recs = [r for r in await gw.store.run(bs.get_batches(gw.keys, ids[:limit])) if r]
    data = [batch_object(r) for r in recs]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ids) > limit,
    }


@router.post("/v1/batches/{batch_id}/cancel", summary="Cancel a batch (cancelling, then cancelled)")
async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    owner = await _owner(gw, request)
    await _owned_batch(gw, owner, batch_id)
    await gw.store.run(bs.request_cancel(gw.keys, batch_id, int(time.time())))
    return batch_object(await gw.store.run(bs.get_batch(gw.keys, batch_id)))
