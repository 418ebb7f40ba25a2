"""What the gateway + Redis path adds over calling the engine directly, and the requests/s it sustains.

The engine is `InstantEngine`, a FAKE USED FOR THIS BENCHMARK ONLY: it answers every request with
`max_tokens` fixed words in one step, so the figures are the data plane alone (HTTP parsing, auth,
validation, tokenization of the prompt, admit.lua, XADD, XREADGROUP, the reply stream, JSON).

Everything runs on this machine over loopback: a real redis-server, the gateway (`lorafn gateway serve`,
one uvicorn process) and one worker (`lorafn worker serve --engine-factory bench.gateway:instant_engine`)
as processes; the client is httpx with keep-alive. Bounded: `--requests` sequential requests for latency,
then `--seconds` of `--concurrency` closed-loop clients for throughput.

    python bench/gateway.py [--requests 2000] [--seconds 5] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lorafn.runtime.outputs import StreamDelta  # noqa: E402

FN, KEY = "bench/echo", "sk-bench-0123456789"
WORDS = 8


class InstantEngine:
    """FAKE ENGINE, for this benchmark only: every request finishes in the first step."""

    def __init__(self) -> None:
        self.reqs: dict[str, int] = {}

    def add_request(self, prompt, params, request_id=None) -> str:
        self.reqs[request_id] = len(prompt) if isinstance(prompt, list) else 0
        return request_id

    def step(self) -> list[StreamDelta]:
        out = [
            StreamDelta(
                rid, [0] * WORDS, "word " * WORDS, True, "length", prompt_tokens=n, completion_tokens=WORDS
            )
            for rid, n in self.reqs.items()
        ]
        self.reqs.clear()
        return out

    def abort(self, request_id) -> bool:
        return self.reqs.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.reqs)


def instant_engine(settings, record) -> InstantEngine:
    return InstantEngine()


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_mean_s(c) -> float:
    """Mean duration of /v1/completions as the gateway's own histogram saw it."""
    total = count = 0.0
    for line in c.get("/metrics").text.splitlines():
        if line.startswith('lorafn_gateway_request_duration_seconds_sum{endpoint="completions"}'):
            total = float(line.split()[-1])
        if line.startswith('lorafn_gateway_request_duration_seconds_count{endpoint="completions"}'):
            count = float(line.split()[-1])
    return total / max(count, 1.0)


def direct_latency(n: int) -> list[float]:
    """The baseline: the same engine called in-process (add_request + step)."""
    from lorafn.runtime.sampling_params import SamplingParams

    engine, params, out = InstantEngine(), SamplingParams(max_tokens=WORDS, temperature=0.0), []
    for i in range(n):
        t = time.perf_counter()
        engine.add_request(f"r{i}", "hello", params, [1, 2, 3])
        while engine.has_unfinished():
            engine.step()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    load = os.getloadavg()  # other work on the machine inflates every figure: report it

    import httpx

    from lorafn.local.redis_proc import RedisProcess, free_port
    from lorafn.models.random_model import write_random_model
    from lorafn.store import Keys, Store
    from lorafn.store import registry as reg

    tmp = Path(tempfile.mkdtemp(prefix="lorafn-bench-"))
    model_dir = write_random_model("tiny", tmp / "tiny", seed=0, progress=False)  # tokenizer for the gateway
    procs: list[subprocess.Popen] = []
    with RedisProcess(data_dir=tmp / "redis", appendonly=False) as redis_proc:
        store, keys = Store(redis_proc.url), Keys("bench")
        store.run(reg.put_function(keys, reg.FunctionRecord(FN, {}, model_dir=str(model_dir))))
        salt = store.run(reg.ensure_salt(keys))
        store.run(reg.set_api_keys(keys, FN, [reg.hash_api_key(salt, KEY)]))
        port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "LORAFN_REDIS_URL": redis_proc.url,
            "LORAFN_KEY_PREFIX": "bench",
            "LORAFN_RATE_LIMIT_RPS": "0",
            "LORAFN_LOG_LEVEL": "warning",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "lorafn.cli", "gateway", "serve", "--port", str(port)],
                env=env,
                cwd=REPO,
            )
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "lorafn.cli",
                    "worker",
                    "serve",
                    "--function",
                    FN,
                    "--engine-factory",
                    "bench.gateway:instant_engine",
                ],
                env={**env, "LORAFN_LOG_LEVEL": "WARNING"},
                cwd=REPO,
            )
        )
        try:
            url = f"http://127.0.0.1:{port}"
            body = {"model": FN, "prompt": "hello", "max_tokens": WORDS, "temperature": 0}
            headers = {"Authorization": f"Bearer {KEY}"}
            with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        if c.post("/v1/completions", json=body).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError("gateway/worker did not come up")
                    time.sleep(0.2)
                for _ in range(200):  # warm-up
                    c.post("/v1/completions", json=body)
                floor = []  # HTTP alone: the same client and server, an endpoint that does nothing
                floor_cpu0 = _cpu_s(procs[0].pid)
                for _ in range(args.requests):
                    t = time.perf_counter()
                    c.get("/healthz")
                    floor.append(time.perf_counter() - t)
                floor_cpu_ms = (_cpu_s(procs[0].pid) - floor_cpu0) * 1000 / args.requests
                pids = {"gateway": procs[0].pid, "worker": procs[1].pid, "redis": redis_proc.pid}
                cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}
                lat = []
                for _ in range(args.requests):
                    t = time.perf_counter()
                    r = c.post("/v1/completions", json=body)
                    lat.append(time.perf_counter() - t)
                    assert r.status_code == 200, r.text
                cpu_ms = {
                    name: (_cpu_s(pid) - cpu0[name]) * 1000 / args.requests for name, pid in pids.items()
                }
                server_mean = _server_mean_s(c)  # inside the gateway process, first byte in to last byte out
            direct = direct_latency(args.requests)

            done, errors = [0], [0]
            stop_at = time.monotonic() + args.seconds

            def client_loop() -> None:
                with httpx.Client(base_url=url, headers=headers, timeout=30) as cc:
                    while time.monotonic() < stop_at:
                        ok = cc.post("/v1/completions", json=body).status_code == 200
                        done[0] += ok
                        errors[0] += not ok

            t0 = time.monotonic()
            threads = [threading.Thread(target=client_loop) for _ in range(args.concurrency)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rps = done[0] / (time.monotonic() - t0)
        finally:
            for p in procs:
                p.terminate()
                p.wait(timeout=10)

    ms = 1000.0
    print(
        f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} before the run; loopback; "
        f"{args.requests} sequential requests; engine: InstantEngine (fake, benchmark only)"
    )
    row = "{:44s} {:8.3f} {:8.3f} {:8.3f}"
    print(f"{'path':44s} {'p50 ms':>8s} {'p99 ms':>8s} {'mean ms':>8s}")
    for label, xs in (
        ("engine called directly (in-process)", direct),
        ("HTTP GET /healthz (the HTTP floor)", floor),
        ("HTTP -> gateway -> Redis -> worker -> back", lat),
    ):
        print(row.format(label, _pct(xs, 0.5) * ms, _pct(xs, 0.99) * ms, statistics.mean(xs) * ms))
    print(f"{'  of which inside the gateway process (mean)':44s} {'':8s} {'':8s} {server_mean * ms:8.3f}")
    print(
        "CPU time per request (less sensitive to other load): "
        + ", ".join(f"{name} {v:.3f} ms" for name, v in cpu_ms.items())
        + f"; sum {sum(cpu_ms.values()):.3f} ms; the gateway's for a GET /healthz: {floor_cpu_ms:.3f} ms"
    )
    added50 = (_pct(lat, 0.5) - _pct(direct, 0.5)) * ms
    added99 = (_pct(lat, 0.99) - _pct(direct, 0.99)) * ms
    print(
        f"{'added by gateway + Redis':44s} {added50:8.3f} {added99:8.3f}   (target <= 2 ms at p50: "
        f"{'met' if added50 <= 2 else 'MISSED'})"
    )
    print(
        f"sustained: {rps:.0f} requests/s with {args.concurrency} concurrent clients "
        f"for {args.seconds:.0f} s ({errors[0]} errors)"
    )


if __name__ == "__main__":
    main()
