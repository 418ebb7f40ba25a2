"""Offline batches (the OpenAI Files and Batch API, docs/batch.md): file and batch records, the runner's
bookkeeping, and the submission of batch requests into a function's request stream.

- File `<p>:file:<id>` (hash): `function` (the owner: only its keys see it), `purpose`, `filename`,
  `bytes`, `created_at`, `path` (where the platform's file store keeps the content). Listed per
  function in `<p>:fn:<f>:files`.
- Batch `<p>:batch:<id>` (hash): the fields of the OpenAI batch object (`status`, `endpoint`,
  `input_file_id`, `output_file_id`, `error_file_id`, timestamps, `metadata` JSON), `function`,
  `total`, `completed`, `failed` (request counts), `requests_path` (the validated requests the gateway
  prepared). Listed per function in `<p>:fn:<f>:batches`; unfinished ones in `<p>:batches:active`.
- Exactly once: each answered request is recorded under its `custom_id` in the batch's results (or
  errors) hash by one Lua step (`batch_outcome.lua`) that refuses a second record, and the output and
  error files are written from these hashes when the batch ends. `inflight` maps a custom_id to the
  request id it was last submitted under, so a runner that took over reads the same reply streams.

Batch requests go into the same request stream as online ones, without a deadline (`deadline` 0: a
worker never expires them) and with `params.priority` = 1 (`protocol.PRIORITY_BATCH`): the worker's
scheduler admits them only into what online requests leave. They skip `admit.lua`'s rate limit and
arrival counters (those are the online traffic's: batch work must not use up a function's rate limit).
"""

from __future__ import annotations

from typing import Any

from lorafn.store.client import Op, eval_script
from lorafn.store.control import _RENEW
from lorafn.store.keys import Keys, check_id
from lorafn.store.protocol import RequestBody

# Batch states (the OpenAI batch object's `status`).
VALIDATING, FAILED, IN_PROGRESS, FINALIZING = "validating", "failed", "in_progress", "finalizing"
COMPLETED, EXPIRED, CANCELLING, CANCELLED = "completed", "expired", "cancelling", "cancelled"
STATES = (VALIDATING, FAILED, IN_PROGRESS, FINALIZING, COMPLETED, EXPIRED, CANCELLING, CANCELLED)
FINAL_STATES = (FAILED, COMPLETED, EXPIRED, CANCELLED)


def _fields(values: dict[str, Any]) -> dict[str, str]:
    return {k: "" if v is None else str(v) for k, v in values.items()}


# -- files ----------------------------------------------------------------------------------------
def put_file(keys: Keys, function: str, file_id: str, record: dict[str, Any]) -> Op[None]:
    """Register a file of `function` (its content is already in the file store)."""

    def build(pipe: Any) -> None:
        pipe.hset(keys.file(file_id), mapping=_fields({**record, "id": file_id, "function": function}))
        pipe.zadd(keys.files(function), {file_id: float(record.get("created_at") or 0)})

    return Op(build, lambda r: None)


def get_file(keys: Keys, file_id: str) -> Op[dict[str, str]]:
    """The file's record; {} when there is none."""
    return Op(lambda pipe: pipe.hgetall(keys.file(file_id)), lambda r: dict(r[0] or {}))


def list_file_ids(keys: Keys, function: str, limit: int) -> Op[list[str]]:
    """The function's newest files first."""
    return Op(lambda pipe: pipe.zrevrange(keys.files(function), 0, max(0, limit - 1)), lambda r: list(r[0]))


def delete_file(keys: Keys, function: str, file_id: str) -> Op[None]:
    def build(pipe: Any) -> None:
        pipe.delete(keys.file(file_id))
        pipe.zrem(keys.files(function), file_id)

    return Op(build, lambda r: None)


# -- batches --------------------------------------------------------------------------------------
def create_batch(
    keys: Keys, function: str, batch_id: str, record: dict[str, Any], errors: dict[str, str] | None = None
) -> Op[None]:
    """Register a batch (with the error lines its validation found); an unfinished one joins the
    runner's active set."""

    def build(pipe: Any) -> None:
        pipe.hset(keys.batch(batch_id), mapping=_fields({**record, "id": batch_id, "function": function}))
        if errors:
            pipe.hset(keys.batch_errors(batch_id), mapping=errors)
        pipe.zadd(keys.batches(function), {batch_id: float(record.get("created_at") or 0)})
        if record.get("status") not in FINAL_STATES:
            pipe.sadd(keys.active_batches(), batch_id)

    return Op(build, lambda r: None)


def get_batch(keys: Keys, batch_id: str) -> Op[dict[str, str]]:
    return Op(lambda pipe: pipe.hgetall(keys.batch(batch_id)), lambda r: dict(r[0] or {}))


def get_batches(keys: Keys, batch_ids: list[str]) -> Op[list[dict[str, str]]]:
    """The records of `batch_ids`, in order ({} for one that is gone)."""
    ids = list(batch_ids)

    def build(pipe: Any) -> None:
        for batch_id in ids:
            pipe.hgetall(keys.batch(batch_id))

    return Op(build, lambda r: [dict(h or {}) for h in r])


def list_batch_ids(keys: Keys, function: str, limit: int, after: str | None = None) -> Op[list[str]]:
    """The function's batches, newest first; `after` (a batch id) pages on past that batch."""

    def build(pipe: Any) -> None:
        pipe.zrevrange(keys.batches(function), 0, -1)

    def parse(r: list[Any]) -> list[str]:
        ids = list(r[0])
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        return ids[: max(0, limit)]

    return Op(build, parse)


def update_batch(keys: Keys, batch_id: str, fields: dict[str, Any]) -> Op[None]:
    return Op(lambda pipe: pipe.hset(keys.batch(batch_id), mapping=_fields(fields)), lambda r: None)


def request_cancel(keys: Keys, batch_id: str, now_s: int) -> Op[str]:
    """An unfinished batch becomes `cancelling` (lua/batch_cancel.lua); the status after the call, ''
    when there is no such batch."""
    return Op(
        lambda pipe: eval_script(pipe, "batch_cancel", [keys.batch(batch_id)], [int(now_s)]),
        lambda r: str(r[0] or ""),
    )


# -- the batch runner -----------------------------------------------------------------------------
def acquire_runner_lease(keys: Keys, holder: str, ttl_ms: int) -> Op[bool]:
    """Take or renew the batch runner's lease (one active runner per deployment)."""
    return Op(
        lambda pipe: pipe.eval(_RENEW, 1, keys.batch_runner_lease(), holder, int(ttl_ms)),
        lambda r: bool(r[0]),
    )


_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def release_runner_lease(keys: Keys, holder: str) -> Op[bool]:
    """Give the lease up (a gateway that stops): another replica's runner takes over at its next tick."""
    return Op(lambda pipe: pipe.eval(_RELEASE, 1, keys.batch_runner_lease(), holder), lambda r: bool(r[0]))


def set_backlog(keys: Keys, counts: dict[str, int], ttl_ms: int) -> Op[None]:
    """The runner's backlog per function (pending, not yet submitted requests; zeros left out), replacing
    the previous one; it expires after ``ttl_ms`` unless the next tick writes it again."""

    def build(pipe: Any) -> None:
        pipe.delete(keys.batch_backlog())
        left = {f: str(int(n)) for f, n in counts.items() if n > 0}
        if left:
            pipe.hset(keys.batch_backlog(), mapping=left)
            pipe.pexpire(keys.batch_backlog(), int(ttl_ms))

    return Op(build, lambda r: None)


def backlogs(keys: Keys) -> Op[dict[str, int]]:
    """function -> its batch backlog (functions without one are absent)."""
    return Op(
        lambda pipe: pipe.hgetall(keys.batch_backlog()),
        lambda r: {str(f): int(n) for f, n in (r[0] or {}).items()},
    )


def active_batch_ids(keys: Keys) -> Op[list[str]]:
    return Op(lambda pipe: pipe.smembers(keys.active_batches()), lambda r: sorted(r[0] or ()))


def progress(keys: Keys, batch_id: str) -> Op[tuple[set[str], set[str], dict[str, str]]]:
    """(answered custom_ids, failed custom_ids, inflight custom_id -> `<rid>|<attempt>`)."""

    def build(pipe: Any) -> None:
        pipe.hkeys(keys.batch_results(batch_id))
        pipe.hkeys(keys.batch_errors(batch_id))
        pipe.hgetall(keys.batch_inflight(batch_id))

    return Op(build, lambda r: (set(r[0] or ()), set(r[1] or ()), dict(r[2] or {})))


def outcome_lines(keys: Keys, batch_id: str) -> Op[tuple[dict[str, str], dict[str, str]]]:
    """(custom_id -> output line, custom_id -> error line): what the output and error files hold."""

    def build(pipe: Any) -> None:
        pipe.hgetall(keys.batch_results(batch_id))
        pipe.hgetall(keys.batch_errors(batch_id))

    return Op(build, lambda r: (dict(r[0] or {}), dict(r[1] or {})))


OUTCOMES = ("completed", "failed", "cancelled")


def record_outcome(keys: Keys, batch_id: str, custom_id: str, line: str, outcome: str) -> Op[bool]:
    """Record one request's output line (`completed`) or error line (`failed`, `cancelled`: counted
    apart) unless its custom_id has one already; True when this call recorded it (lua/batch_outcome.lua)."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
    return Op(
        lambda pipe: eval_script(
            pipe,
            "batch_outcome",
            [
                keys.batch_results(batch_id),
                keys.batch_errors(batch_id),
                keys.batch_inflight(batch_id),
                keys.batch(batch_id),
            ],
            [custom_id, line, outcome],
        ),
        lambda r: bool(r[0]),
    )


def submit(
    keys: Keys, function: str, batch_id: str, requests: list[tuple[str, str, RequestBody, int]]
) -> Op[list[str]]:
    """Append batch requests to the function's request stream and mark them in flight, in one round
    trip. `requests`: (custom_id, request id, body, attempt). Returns the stream entry ids."""
    items = list(requests)

    def build(pipe: Any) -> None:
        if not items:
            return
        for _custom_id, rid, body, _attempt in items:
            # deadline 0: no worker expires a batch request (the batch's own completion window applies)
            pipe.xadd(
                keys.requests(function),
                {"rid": check_id(rid, "request id"), "body": body.encode(), "deadline": "0"},
            )
        pipe.hset(
            keys.batch_inflight(batch_id),
            mapping={custom_id: f"{rid}|{attempt}" for custom_id, rid, _b, attempt in items},
        )

    return Op(build, lambda r: [str(x) for x in r[: len(items)]])


def finish_batch(keys: Keys, batch_id: str, fields: dict[str, Any]) -> Op[None]:
    """The batch's files are written: record its final fields, leave the active set, drop the
    bookkeeping hashes (the files hold their content now)."""

    def build(pipe: Any) -> None:
        pipe.hset(keys.batch(batch_id), mapping=_fields(fields))
        pipe.srem(keys.active_batches(), batch_id)
        pipe.delete(keys.batch_results(batch_id), keys.batch_errors(batch_id), keys.batch_inflight(batch_id))

    return Op(build, lambda r: None)
