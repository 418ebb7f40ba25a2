"""The OpenAI Batch API (docs/batch.md) with the official `openai` client, over real HTTP, a real
redis-server and workers running the serving loop: a real CPU engine (tiny Llama) for the answers; worker
processes with the fake engine for the kill test (the data plane is what is under test there)."""

from __future__ import annotations

import io
import json
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from lorafn.gateway.tokenizer import GatewayTokenizer
from lorafn.store import Keys, Store
from lorafn.store import batches as bs
from tests.integration.gateway.harness import (
    RecordingEngine,
    expected_text,
    gateway,
    register,
    start_worker_process,
    stop_process,
    wait_live_workers,
    worker_thread,
)

FN, KEY = "team-a/summarize", "sk-a-0123456789"
OTHER, OTHER_KEY = "team-b/translate", "sk-b-9876543210"


def line(custom_id: Any, body: dict[str, Any], url: str = "/v1/completions", **extra: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def upload(client: openai.OpenAI, lines: list[str]) -> str:
    return client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch").id


def wait_final(client: openai.OpenAI, batch_id: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in bs.FINAL_STATES:
            return b
        time.sleep(0.1)
    raise TimeoutError(f"batch {batch_id} did not end within {timeout} s (status {b.status})")


def jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


@pytest.fixture
def env(
    redis_server: str, tiny_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[str, str, Store, Keys, Path]]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [KEY], model_dir=str(tiny_model_dir))
    register(store, keys, OTHER, [OTHER_KEY], model_dir=str(tiny_model_dir))
    yield redis_server, prefix, store, keys, tmp_path


def test_real_engine_batch_equals_online_answers(env, tiny_model_dir: Path) -> None:
    """Completions and chat through a batch give the real engine's greedy text, like online requests."""
    from lorafn.runtime import Engine, EngineConfig, SamplingParams

    redis_url, prefix, _store, _keys, tmp = env
    prompts = ["The quick brown fox", "Hello", "one two three four five six seven", "lorafn", "a b"]
    config = EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32")
    reference = Engine(config).generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    tok = GatewayTokenizer(tiny_model_dir)
    messages = [{"role": "user", "content": "Hi there"}]
    _text, chat_ids = tok.encode_chat(messages)
    chat_reference = Engine(config).generate([chat_ids], SamplingParams(max_tokens=6, temperature=0.0))[0]
    with (
        gateway(redis_url, prefix, files_dir=tmp / "files", batch_tick_s=0.05) as url,
        worker_thread(redis_url, prefix, FN, engine=Engine(config)),
    ):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        lines = [
            line(f"c{i}", {"model": FN, "prompt": p, "max_tokens": 8, "temperature": 0})
            for i, p in enumerate(prompts)
        ]
        f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
        assert f.purpose == "batch" and f.bytes == len("\n".join(lines).encode())
        assert client.files.retrieve(f.id).filename == "in.jsonl"
        batch = client.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h", metadata={"run": "t"}
        )
        assert batch.status == "in_progress" and batch.request_counts.total == len(prompts)
        chat_file = upload(
            client,
            [
                line(
                    "chat-1",
                    {"model": FN, "messages": messages, "max_tokens": 6, "temperature": 0},
                    "/v1/chat/completions",
                )
            ],
        )
        chat = client.batches.create(
            input_file_id=chat_file, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_final(client, batch.id)
        chat_done = wait_final(client, chat.id)
        assert done.status == "completed" and done.metadata == {"run": "t"}
        assert (done.request_counts.completed, done.request_counts.failed) == (len(prompts), 0)
        assert done.error_file_id is None
        out = jsonl(client, done.output_file_id)
        assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(len(prompts))]  # input order
        for o, ref in zip(out, reference, strict=True):
            body = o["response"]["body"]
            assert o["response"]["status_code"] == 200 and o["error"] is None
            assert body["object"] == "text_completion" and body["model"] == FN
            assert body["choices"][0]["text"] == ref.text
            assert body["usage"]["completion_tokens"] == len(ref.token_ids)
        chat_out = jsonl(client, chat_done.output_file_id)
        assert chat_out[0]["response"]["body"]["choices"][0]["message"]["content"] == chat_reference.text
        listed = client.batches.list(limit=10)
        assert {b.id for b in listed.data} == {batch.id, chat.id}
        # another function's key sees none of it
        other = openai.OpenAI(base_url=f"{url}/v1", api_key=OTHER_KEY, max_retries=0)
        for call in (
            lambda: other.batches.retrieve(batch.id),
            lambda: other.files.retrieve(f.id),
            lambda: other.files.content(done.output_file_id),
            lambda: other.batches.cancel(batch.id),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert other.batches.list().data == []
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="sk-nope-000000", max_retries=0).batches.retrieve(
                batch.id
            )


def test_malformed_lines_go_to_the_error_file_with_a_reason_and_the_rest_run(env) -> None:
    redis_url, prefix, _store, _keys, tmp = env
    ok = {"model": FN, "prompt": "fine", "max_tokens": 3}
    lines = [
        line("a", ok),
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": ok}),  # no custom_id
        line("a", ok),  # duplicate
        line("b", {**ok, "model": OTHER}),  # another function
        line("c", {**ok, "max_tokens": "many"}),  # bad body
        line("d", ok, url="/v1/chat/completions"),  # wrong endpoint
        line("e", {**ok, "max_tokens": 10**6}),  # over the context
        line("f", {**ok, "stream": True}),
        line("g", {"model": FN, "prompt": "also fine", "max_tokens": 2}),
    ]
    with (
        gateway(redis_url, prefix, files_dir=tmp / "files", batch_tick_s=0.05) as url,
        worker_thread(redis_url, prefix, FN),
    ):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        batch = client.batches.create(
            input_file_id=upload(client, lines), endpoint="/v1/completions", completion_window="24h"
        )
        done = wait_final(client, batch.id)
        assert done.status == "completed"
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
            10,
            2,
            8,
        )
        assert [o["custom_id"] for o in jsonl(client, done.output_file_id)] == ["a", "g"]
        errors = jsonl(client, done.error_file_id)
        got = [(e["custom_id"], e["error"]["code"], e["error"]["message"].split(":")[0]) for e in errors]
        assert got == [
            (None, "invalid_json", "line 2"),
            (None, "missing_custom_id", "line 3"),
            ("a", "duplicate_custom_id", "line 4"),
            ("b", "model_mismatch", "line 5"),
            ("c", "invalid_body", "line 6"),
            ("d", "invalid_url", "line 7"),
            ("e", "context_length_exceeded", "line 8"),
            ("f", "invalid_body", "line 9"),
        ]
        assert (
            "max_tokens" in errors[4]["error"]["message"] and "body.stream" in errors[7]["error"]["message"]
        )
        assert all(e["response"] is None and e["id"].startswith("batch_req_") for e in errors)


def test_limits_and_bad_requests_are_clear_4xx(env) -> None:
    redis_url, prefix, _store, _keys, tmp = env
    with gateway(
        redis_url, prefix, files_dir=tmp / "files", max_file_bytes=2048, max_batch_requests=3
    ) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        big = [line(f"x{i}", {"model": FN, "prompt": "p" * 200}) for i in range(12)]
        with pytest.raises(openai.APIStatusError) as e:
            upload(client, big)
        assert e.value.status_code == 413 and "max_file_bytes" in e.value.message
        with pytest.raises(openai.BadRequestError, match="max_batch_requests"):
            upload(client, [line(f"x{i}", {"model": FN, "prompt": "p"}) for i in range(4)])
        with pytest.raises(openai.BadRequestError, match="purpose"):
            client.files.create(file=("in.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
        fid = upload(client, [line("x", {"model": FN, "prompt": "p"})])
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            client.batches.create(input_file_id=fid, endpoint="/v1/embeddings", completion_window="24h")  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            client.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="1h")  # type: ignore[arg-type]
        with pytest.raises(openai.NotFoundError):
            client.batches.create(
                input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"
            )
        r = httpx.post(
            f"{url}/v1/files", headers={"Authorization": f"Bearer {KEY}"}, json={"purpose": "batch"}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"


def test_cancel_stops_submitting_and_marks_the_rest_cancelled(env) -> None:
    redis_url, prefix, _store, _keys, tmp = env
    engine = RecordingEngine(step_s=0.05)
    with (
        gateway(
            redis_url, prefix, files_dir=tmp / "files", batch_tick_s=0.05, batch_max_inflight_per_worker=2
        ) as url,
        worker_thread(redis_url, prefix, FN, engine=engine),
    ):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        lines = [line(f"r{i}", {"model": FN, "prompt": f"p {i}", "max_tokens": 8}) for i in range(40)]
        batch = client.batches.create(
            input_file_id=upload(client, lines), endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        done = wait_final(client, batch.id)
        submitted = len(engine.added)
        time.sleep(0.5)
        assert len(engine.added) == submitted  # nothing submitted after the cancel
        assert done.status == "cancelled" and done.cancelled_at is not None
        out, errors = jsonl(client, done.output_file_id), jsonl(client, done.error_file_id)
        assert 2 <= len(out) < 40 and submitted < 40
        assert all(e["error"]["code"] == "batch_cancelled" for e in errors)
        assert sorted(o["custom_id"] for o in out + errors) == sorted(f"r{i}" for i in range(40))
        assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling a finished batch: no change


def _held_by(store: Store, keys: Keys, pid: int) -> int:
    """Batch entries the worker process `pid` holds unacknowledged (its consumer's pending count)."""
    from lorafn.store import streams, workers

    info = store.run(workers.worker_info(keys, store.run(workers.worker_ids(keys))))
    ids = [wid for wid, h in info.items() if h.get("pid") == str(pid)]
    return sum(p for name, p, _idle in store.run(streams.consumers(keys, FN)) if name in ids)


def test_worker_killed_mid_batch_every_custom_id_exactly_once(env, tiny_model_dir: Path) -> None:
    """Two worker processes; one is SIGKILLed while it holds batch requests: the survivor re-claims them
    (XAUTOCLAIM path, restart events), and the output has every custom_id exactly once."""
    redis_url, prefix, store, keys, tmp = env
    procs = [
        start_worker_process(
            redis_url, prefix, FN, tmp / f"w{i}.log", LORAFN_TEST_STEP_S="0.05", LORAFN_MAX_RUNNING="8"
        )
        for i in range(2)
    ]
    try:
        wait_live_workers(None, store, keys, FN, 2)
        with gateway(
            redis_url,
            prefix,
            files_dir=tmp / "files",
            batch_tick_s=0.05,
            batch_max_inflight_per_worker=6,
            heartbeat_ttl_s=1.0,
        ) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            n = 60
            lines = [line(f"k{i}", {"model": FN, "prompt": f"kill {i}", "max_tokens": 8}) for i in range(n)]
            batch = client.batches.create(
                input_file_id=upload(client, lines), endpoint="/v1/completions", completion_window="24h"
            )
            deadline = time.monotonic() + 60
            while client.batches.retrieve(batch.id).request_counts.completed < 10 or not _held_by(
                store, keys, procs[0].pid
            ):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            procs[0].send_signal(signal.SIGKILL)  # it holds batch requests: they must be re-claimed
            procs[0].wait(timeout=10)
            done = wait_final(client, batch.id, timeout=180)
            out = jsonl(client, done.output_file_id)
            ids = [o["custom_id"] for o in out]
            assert done.status == "completed" and done.request_counts.completed == n
            assert sorted(ids) == sorted(f"k{i}" for i in range(n)) and len(set(ids)) == n
            tok = GatewayTokenizer(tiny_model_dir)
            for o in out:  # a restarted request's text starts over: never the dead worker's prefix twice
                prompt = f"kill {o['custom_id'][1:]}"
                assert o["response"]["body"]["choices"][0]["text"] == expected_text(
                    ",".join(map(str, tok.encode(prompt))), 8
                )
    finally:
        for p in procs:
            stop_process(p)


def test_no_worker_records_cold_start_demand_and_the_cli_waits_for_the_batch(env) -> None:
    """A batch for a function with no live worker records demand as an online request does; once a worker
    is up the batch completes. Driven by `lorafn batch` (create --wait, get, results), metrics counted."""
    from typer.testing import CliRunner

    from lorafn.cli import app
    from lorafn.store import streams

    redis_url, prefix, store, keys, tmp = env
    src = tmp / "in.jsonl"
    src.write_text(
        "\n".join(line(f"q{i}", {"model": FN, "prompt": f"cold {i}", "max_tokens": 3}) for i in range(6))
    )
    runner = CliRunner()
    with gateway(redis_url, prefix, files_dir=tmp / "files", batch_tick_s=0.05) as url:
        args = ["--url", url, "--api-key", KEY]
        created = runner.invoke(app, ["batch", "create", str(src), "--endpoint", "/v1/completions", *args])
        assert created.exit_code == 0, created.output
        batch_id = json.loads(created.output)["id"]
        deadline = time.monotonic() + 30
        while not [f for _e, f in store.run(streams.read_demand(keys, "0", None)) if f.get("function") == FN]:
            assert time.monotonic() < deadline, "no cold-start demand recorded for the batch"
            time.sleep(0.05)
        demand = [f for _e, f in store.run(streams.read_demand(keys, "0", None)) if f.get("function") == FN]
        assert demand[0].get("reason") == "batch"
        with worker_thread(redis_url, prefix, FN):
            waited = runner.invoke(app, ["batch", "get", batch_id, *args])
            assert waited.exit_code == 0 and json.loads(waited.output)["id"] == batch_id
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            assert wait_final(client, batch_id).status == "completed"
            waited = runner.invoke(
                app, ["batch", "create", str(src), "--endpoint", "/v1/completions", "--wait", *args]
            )
            assert waited.exit_code == 0 and '"status": "completed"' in waited.output, waited.output
        got = runner.invoke(app, ["batch", "results", batch_id, *args])
        assert got.exit_code == 0
        assert sorted(json.loads(x)["custom_id"] for x in got.output.splitlines()) == [
            f"q{i}" for i in range(6)
        ]
        metrics = httpx.get(f"{url}/metrics").text
        assert 'lorafn_batches_finished_total{state="completed"}' in metrics
        assert 'lorafn_batch_requests_total{outcome="completed"} 12.0' in metrics
        nokey = runner.invoke(app, ["batch", "get", batch_id, "--url", url, "--api-key", "sk-wrong-0000"])
        assert nokey.exit_code == 2 and "401" in nokey.output


def test_a_new_runner_takes_over_a_batch_mid_way_and_writes_each_custom_id_once(env) -> None:
    """The gateway running the batch runner stops mid-batch (its lease is handed over); another gateway's
    runner rebuilds the state from Redis and the file store, reads the in-flight requests' reply streams
    again, and the output still has every custom_id exactly once."""
    redis_url, prefix, store, keys, tmp = env
    n = 40
    lines = [line(f"t{i}", {"model": FN, "prompt": f"take over {i}", "max_tokens": 6}) for i in range(n)]
    opts = {"files_dir": tmp / "files", "batch_tick_s": 0.05, "batch_max_inflight_per_worker": 8}
    # steps slow enough (6 tokens: ~0.9 s a request) that requests are still running when the first gateway
    # has shut down: at 0.03 s a step a slow CI machine finished every in-flight one during the shutdown
    with worker_thread(redis_url, prefix, FN, engine=RecordingEngine(step_s=0.15)) as _w:
        with gateway(redis_url, prefix, **opts) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            batch_id = client.batches.create(
                input_file_id=upload(client, lines), endpoint="/v1/completions", completion_window="24h"
            ).id
            deadline = time.monotonic() + 60
            # stop it mid-batch: some answered and a wave in flight (a wave answered at once leaves nothing in
            # flight until the runner's next tick submits the next one: stopping then tests no hand-over)
            while (
                client.batches.retrieve(batch_id).request_counts.completed < 5
                or not store.run(bs.progress(keys, batch_id))[2]
            ):
                assert time.monotonic() < deadline
                time.sleep(0.02)
        # the first gateway is gone with requests in flight (they keep running on the worker)
        assert store.run(bs.progress(keys, batch_id))[2], "nothing was in flight at the hand-over"
        with gateway(redis_url, prefix, **opts) as url2:
            client2 = openai.OpenAI(base_url=f"{url2}/v1", api_key=KEY, max_retries=0)
            done = wait_final(client2, batch_id)
            ids = [o["custom_id"] for o in jsonl(client2, done.output_file_id)]
    assert done.status == "completed" and done.request_counts.completed == n
    assert ids == [f"t{i}" for i in range(n)]


class _FailingEngine(RecordingEngine):
    """Its engine step fails once some requests run: the worker ends them with `engine_error` and exits."""

    def step(self):  # type: ignore[no-untyped-def]
        if len(self.added) >= 3:
            raise RuntimeError("injected engine failure")
        return super().step()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected failure
def test_requests_of_a_failed_engine_are_resubmitted_and_written_once(env) -> None:
    """The worker's engine fails with batch requests running (`engine_error`, the worker exits): the runner
    resubmits them under new request ids; another worker answers each once."""
    redis_url, prefix, _store, _keys, tmp = env
    failing, healthy = _FailingEngine(step_s=0.02), RecordingEngine(step_s=0.02)
    n = 12
    lines = [line(f"f{i}", {"model": FN, "prompt": f"retry {i}", "max_tokens": 4}) for i in range(n)]
    with gateway(redis_url, prefix, files_dir=tmp / "files", batch_tick_s=0.05) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        with worker_thread(redis_url, prefix, FN, engine=failing):
            batch_id = client.batches.create(
                input_file_id=upload(client, lines), endpoint="/v1/completions", completion_window="24h"
            ).id
            deadline = time.monotonic() + 30
            while len(failing.added) < 3:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.3)  # the failed step's engine_error events reach the runner
        with worker_thread(redis_url, prefix, FN, engine=healthy):
            done = wait_final(client, batch_id)
        ids = [o["custom_id"] for o in jsonl(client, done.output_file_id)]
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (
        n,
        0,
    )
    assert sorted(ids) == sorted(f"f{i}" for i in range(n))
    retried = set(failing.added)  # request ids the failed engine held: none of them answered
    assert retried and len(healthy.added) == n and not retried & set(healthy.added)


def test_the_runner_publishes_its_backlog_as_demand_and_clears_it_when_done(env) -> None:
    """What the live workers had no room for is written per function for the controller (more workers from
    the warm pool, docs/batch.md); when all is submitted the record goes; it expires with the runner."""
    redis_url, prefix, store, keys, tmp = env
    engine = RecordingEngine(step_s=0.05)
    with (
        gateway(
            redis_url, prefix, files_dir=tmp / "files", batch_tick_s=0.05, batch_max_inflight_per_worker=2
        ) as url,
        worker_thread(redis_url, prefix, FN, engine=engine),
    ):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        lines = [line(f"r{i}", {"model": FN, "prompt": f"p {i}", "max_tokens": 2}) for i in range(30)]
        batch = client.batches.create(
            input_file_id=upload(client, lines), endpoint="/v1/completions", completion_window="24h"
        )
        seen: list[int] = []
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).status not in bs.FINAL_STATES:
            assert time.monotonic() < deadline
            seen.append(store.run(bs.backlogs(keys)).get(FN, 0))
            time.sleep(0.02)
        assert max(seen) >= 20  # one worker, 2 in flight: most of the 30 wait in the runner
        assert max(seen) <= 30 - 2
        assert store.run(bs.backlogs(keys)) == {}  # nothing left: no demand
    # a runner that stops publishing leaves no stale demand behind (the record expires)
    store.run(bs.set_backlog(keys, {FN: 100, OTHER: 0}, ttl_ms=200))
    assert store.run(bs.backlogs(keys)) == {FN: 100}  # zeros are left out
    time.sleep(0.4)
    assert store.run(bs.backlogs(keys)) == {}
