"""Where a request's time goes, seen from both ends (issue 10: a cold start's gap was unexplained because
nothing logged per request): the gateway's line (received -> authorized -> enqueued -> accepted -> first
delta -> done) and its phase histograms, the worker's line (queued, held, prefill, first token) for the
same request id, and the gateway loading registered backbones' tokenizers before their first request (and
freezing its heap after)."""

from __future__ import annotations

import gc
import logging
import re
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from lorafn.gateway.tokenizer import load_tokenizer
from lorafn.store import Keys, Store
from lorafn.store.backbones import BackboneRecord, put_backbone
from tests.integration.gateway.harness import gateway, register, worker_thread

FN, KEY = "team-a/timed", "sk-timed-0123456789"


def _fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", line))


def _lines(caplog: pytest.LogCaptureFixture, logger: str, rid: str) -> list[dict[str, str]]:
    return [
        _fields(r.getMessage())
        for r in caplog.records
        if r.name == logger and f"rid={rid} " in r.getMessage()
    ]


def test_each_request_logs_its_stages_in_the_gateway_and_the_worker(
    redis_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lorafn")
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    register(store, keys, FN, [KEY])
    with gateway(redis_server, prefix, keep_warm_s=0) as url, worker_thread(redis_server, prefix, FN):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        rids = []
        for _ in range(2):
            chunks = list(client.completions.create(model=FN, prompt="a b c", max_tokens=4, stream=True))
            rids.append(chunks[0].id.removeprefix("cmpl-"))
        deadline = time.monotonic() + 5  # the worker logs once its last events are sent
        while time.monotonic() < deadline and not _lines(caplog, "lorafn.worker", rids[1]):
            time.sleep(0.05)
        metrics = httpx.get(f"{url}/metrics").text

    for i, rid in enumerate(rids):
        (gw,) = _lines(caplog, "lorafn.gateway", rid)
        assert gw["function"] == FN and gw["start"] == "warm" and gw["outcome"] == "length", gw
        stages = ["authorized", "prepared", "enqueued", "accepted", "first_delta", "first_text", "done"]
        times = [float(gw[f"{s}_ms"]) for s in stages]
        assert times == sorted(times) and times[0] >= 0, gw  # every stage, in the order they happen
        (wk,) = _lines(caplog, "lorafn.worker", rid)
        assert wk["function"] == FN and wk["finish"] == "length", wk
        assert wk["completion_tokens"] == "4" and wk["steps"] == "1", wk
        assert wk["first_of_worker"] == str(int(i == 0)), wk
        for name in ("queued_ms", "held_ms", "prefill_ms", "first_token_ms", "total_ms", "gc_ms"):
            assert float(wk[name]) >= 0, (name, wk)
        assert float(wk["first_token_ms"]) <= float(wk["total_ms"]), wk
    for phase in ("admission", "accept", "first_delta"):
        assert f'lorafn_gateway_request_phase_seconds_count{{phase="{phase}",start="warm"}} 2.0' in metrics


def test_the_gateway_loads_registered_backbones_tokenizers_before_any_request(
    redis_server: str, tiny_model_dir: Path
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store, keys = Store(redis_server), Keys(prefix)
    store.run(put_backbone(keys, BackboneRecord("tiny", str(tiny_model_dir), "float32", {})))
    load_tokenizer.cache_clear()
    gc.unfreeze()
    try:
        with gateway(redis_server, prefix, keep_warm_s=0.1, freeze_heap=True):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not gc.get_freeze_count():
                time.sleep(0.05)
            assert load_tokenizer.cache_info().currsize == 1
            hits = load_tokenizer.cache_info().hits
            load_tokenizer(str(tiny_model_dir))  # a request's lookup now finds it loaded
            assert load_tokenizer.cache_info().hits == hits + 1
            assert gc.get_freeze_count() > 0  # and what was alive then is out of later full collections
    finally:
        gc.unfreeze()  # this test process collects as before
