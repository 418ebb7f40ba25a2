"""KV for a burst, across the seams (`PolicyConfig.burst_kv_bytes`): `lorafn up` on CPU with `burst_kv_mib: 8`
(up.yaml -> LocalConfig -> the controller's policy), one function at `maxReplicas: 1` whose spec gives its
worker a 1 MiB KV cache (512 tokens of the tiny model: the worker holds two requests at first,
`runtime.read_cap`). Sixteen concurrent completions through the official `openai` client: the requests the
worker has no room for wait in the function's queue, the controller sends the busy worker a larger
`kv_budget`, the worker resizes while its requests run (`kv_resized`) and reads more of the queue; every
request is answered in full by that one process, and once it has been idle `kv_grant_idle_s` it is sent its
function's 1 MiB back. Asserted are behaviours (lifecycle events, control commands, answers), not times."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lorafn.store import control, workers
from tests.integration.local.platform_helpers import one_function

pytestmark = pytest.mark.slow

FN = "burst/f1"
MiB = 1 << 20
MAX_TOKENS = 96


def test_a_burst_grows_its_workers_kv_and_gives_it_back(tiny_model_dir: Path, tmp_path: Path) -> None:
    import openai

    with one_function(tiny_model_dir, tmp_path, FN, {"burst_kv_mib": 8}, kv_cache_mib=1) as one:
        platform, wid, beat = one.platform, one.worker_id, one.beat
        store = platform.store
        assert store is not None
        assert beat.get("kv_grant") == "0" and int(beat["kv_budget_bytes"]) == MiB

        client = openai.OpenAI(base_url=f"{one.gateway_url}/v1", api_key=one.key, max_retries=0, timeout=180)

        def ask(i: int) -> tuple[int, str]:
            r = client.completions.create(
                model=FN,
                prompt=f"Question {i}: {i} cows. How many legs?",
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            return r.usage.completion_tokens, r.choices[0].finish_reason

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(ask, range(16)))
        # greedy on random weights may end at EOS before MAX_TOKENS: each answer is whole either way
        for n, reason in answers:
            whole = n == MAX_TOKENS and reason == "length"
            assert whole or (1 <= n < MAX_TOKENS and reason == "stop"), (n, reason)

        def resized() -> list[dict[str, str]]:
            return [
                e for _id, e in store.run(control.read_events(platform.keys, "0-0"))
                if e.get("kind") == control.KV_RESIZED and e.get("worker") == wid
            ]  # fmt: skip

        grown = [e for e in resized() if int(e["budget_bytes"]) > MiB]
        assert grown, platform.log_tail(80)  # the queue behind the busy worker got it more KV
        assert int(grown[0]["kv_bytes"]) > MiB and int(grown[0]["budget_bytes"]) <= 8 * MiB
        deadline = time.monotonic() + 60
        while int(resized()[-1]["budget_bytes"]) != MiB:  # the return comes once it has been idle
            assert time.monotonic() < deadline, platform.log_tail(60)
            time.sleep(0.2)
        assert int(resized()[-1]["kv_bytes"]) <= MiB
        sent = [c for _id, c in store.run(workers.read_control(platform.keys, wid, "0-0"))]
        assert {c["cmd"] for c in sent} == {"kv_budget"}  # no stop, park or bind: the same worker throughout
        assert int(sent[0]["bytes"]) > MiB and int(sent[-1]["bytes"]) == MiB
        assert wid in platform.workers() and len(platform.workers()) == 1
