"""Cold start, side by side in one run, through the real platform (`lorafn up`, gateway, Redis, controller):

  warm       a bound worker already serving the function (median of --repeats; each request a prompt
             length the run has not sent before, as each cold request is)
  warm-same  the same worker, one prompt repeated (what a repeated prompt hides)
  standby    a function's first request, served by a standby worker of the warm pool (median over
             --standby-repeats functions, one cold start each); each but the first is followed at once
             by one warm request, and the ratio per pair is printed too (drift-free)
  fresh      the first request of a function whose backbone keeps no warm pool (a new worker process)
  no-share   a process that loads its own copy of the weights and answers one request (the baseline of
             serving without a shared backbone: spawn -> engine from safetensors -> first token)

TTFT is measured by the client (the `openai` package, streaming) from sending the request to the first
text; the controller's own record of each cold start (bind or spawn -> serving, ms) is printed beside it.
Then, with --density N: N functions with a small KV budget each (`resources.kvCacheMiB`) are invoked at
once, and the run reports how many got a bound worker on the one GPU and the GPU memory per function.

    # the numbers for docs/benchmarks.md (H100, the llama-2-7b preset, r16 all-linear adapters)
    python bench/coldstart.py --model /tmp/llama-2-7b --device cuda --json $OUT/coldstart.json
    python bench/coldstart.py --model /tmp/llama-2-7b --device cuda --density 120 --kv-mib 64
    # CPU (ratios only), the tiny preset:
    python bench/coldstart.py --preset tiny --workdir /tmp/cs --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lorafn.gateway.relay import MARKS  # noqa: E402  (after the path set-up above)

MiB = 1 << 20


def lorafn(*args: str, state_dir: Path, timeout: float = 600) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "lorafn.cli", *args, "--state-dir", str(state_dir)],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"lorafn {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def gpu_used_bytes() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:
        return None


def prompt_of(tokens: int) -> str:
    # ~1 token per word for a byte-level BPE over common words
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "wizards",
        "quietly",
        "judge",
        "boxing",
    ]
    return " ".join(words[i % len(words)] for i in range(tokens))


def ttft_ms(
    base_url: str, key: str, function: str, prompt: str, max_tokens: int, timeout: float
) -> tuple[float, str]:
    """(the client's TTFT in ms, the request id the gateway gave it: its log lines carry it)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key=key, timeout=timeout, max_retries=0)
    t0 = time.perf_counter()
    first = None
    rid = ""
    stream = client.completions.create(
        model=function, prompt=prompt, max_tokens=max_tokens, stream=True, temperature=0
    )
    for chunk in stream:
        rid = rid or chunk.id.removeprefix("cmpl-")
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{function}: no text")
    return (first - t0) * 1000, rid


def cpu_ms(pid: int) -> float:
    """CPU time (user + system, ms) the process `pid` has used: what `lorafn up` (supervisor + controller
    rounds) took from the host's cores while a row's request ran (on the 2-core CPU VM that competes with
    the worker's prefill)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def request_stages(logs: Path, rid: str) -> dict[str, float]:
    """One request's stages from the processes' own lines (`request rid=... key=value`): the gateway's
    (`gw_<stage>_ms`, ms since it received the request) and the worker's (`wk_<stage>_ms`: queued, held,
    prefill, first_token, total; `wk_first_of_worker`)."""
    out: dict[str, float] = {}
    for path in sorted(logs.glob("*.log")):
        prefix = "gw_" if path.name.startswith("gateway") else "wk_" if path.name.startswith("worker") else ""
        if not prefix:
            continue
        for line in path.read_text(errors="replace").splitlines():
            if f"request rid={rid} " not in line:
                continue
            for key, value in re.findall(r"(\w+)=(\S+)", line):
                if key.endswith("_ms") or key == "first_of_worker":
                    out[prefix + key] = float(value)
    return out


def no_share_ms(model: Path, adapter: Path, device: str, prompt: str) -> float:
    """Spawn -> first token of a process that loads its own weights (what serving without sharing costs)."""
    code = (
        "import sys,time;from lorafn.runtime import Engine,EngineConfig,SamplingParams;"
        f"e=Engine(EngineConfig(model={str(model)!r},adapter={str(adapter)!r},device={device!r},"
        "num_kv_blocks=256));"
        f"e.generate([{prompt!r}],SamplingParams(max_tokens=1,temperature=0.0));print(time.time())"
    )
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return (float(out.stdout.strip().splitlines()[-1]) - t0) * 1000


def function_doc(name: str, backbone: str, adapter: Path, extra: str = "") -> str:
    return (
        "apiVersion: lorafn.io/v1alpha1\nkind: LoRAFunction\n"
        f"metadata: {{name: {name}, namespace: bench}}\n"
        f"spec: {{backbone: {backbone}, adapter: {{uri: 'file://{adapter}'}}, "
        f"scaling: {{keepAliveSeconds: 3600}}{extra}}}\n"
    )


def backbone_doc(name: str, model: Path, dtype: str, min_standby: int, max_standby: int) -> str:
    return (
        f"apiVersion: lorafn.io/v1alpha1\nkind: Backbone\nmetadata: {{name: {name}}}\n"
        f"spec: {{model: {{uri: 'file://{model}'}}, dtype: {dtype}, "
        f"warmPool: {{minStandby: {min_standby}, maxStandby: {max_standby}}}}}\n"
    )


class Platform:
    def __init__(self, workdir: Path, device: str, config: str) -> None:
        self.state_dir = workdir / "state"
        cfg = workdir / "up.yaml"
        cfg.write_text(config)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "LORAFN_COLD_START_TIMEOUT_S": "600"}
        self.log = (workdir / "up.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lorafn.cli", "up", "--config", str(cfg),
             "--state-dir", str(self.state_dir), "--device", device],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while not (self.state_dir / "platform.json").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lorafn up did not start; see {workdir / 'up.log'}")
            time.sleep(0.2)
        self.state = json.loads((self.state_dir / "platform.json").read_text())
        import redis

        self.redis = redis.Redis.from_url(self.state["redis_url"], decode_responses=True)

    def apply(self, doc: str, key: str | None, workdir: Path, name: str) -> None:
        path = workdir / f"{name}.yaml"
        path.write_text(doc)
        lorafn("apply", "-f", str(path), *(["--api-key", key] if key else []), state_dir=self.state_dir)

    def workers(self) -> dict[str, dict[str, str]]:
        out = {}
        for wid in self.redis.zrange("lorafn:workers", 0, -1):
            h = self.redis.hgetall(f"lorafn:worker:{wid}")
            if h:
                out[wid] = h
        return out

    def wait_standby(self, backbone: str, shape: str, timeout_s: float = 300) -> None:
        """Until a standby of `backbone` prepared for `shape` heartbeats (the pool's floor makes one)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for h in self.workers().values():
                if h.get("state") == "standby" and h.get("backbone") == backbone and h.get("shape") == shape:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"no standby of {backbone} prepared for {shape} came up in {timeout_s} s")

    def wait_pool_settled(self, backbone: str, timeout_s: float = 300, quiet_s: float = 2.0) -> None:
        """Until the backbone's standbys are as many as the controller's pool target and nothing new has
        started for `quiet_s`: a standby still warming up (forwards, graphs) runs beside the warm requests
        and inflates them (on the 2-core CPU VM the warm rows read 0.6-1.2 s beside a 3 s warm-up)."""
        deadline = time.monotonic() + timeout_s
        logs = self.state_dir / "logs"
        seen, stable_since = -1, time.monotonic()
        while time.monotonic() < deadline:
            pool = self.redis.hgetall("lorafn:pool")  # `<gpu>|<backbone>|<shape>` -> standbys wanted
            target = sum(int(v) for k, v in pool.items() if k.split("|")[1:2] == [backbone])
            ready = sum(
                1
                for h in self.workers().values()
                if h.get("state") == "standby" and h.get("backbone") == backbone
            )
            started = len(list(logs.glob("worker_*.log")))
            if started != seen:
                seen, stable_since = started, time.monotonic()
            if ready >= target and time.monotonic() - stable_since >= quiet_s:
                return
            time.sleep(0.25)
        print(f"the pool of {backbone} did not settle within {timeout_s} s; measuring anyway", flush=True)

    def wait_preloaded(self, functions: list[str], timeout_s: float = 60) -> str:
        """Until a standby heartbeats that it holds the adapter of one of `functions` (the controller's
        pre-loading); that function (the first of them if none was pre-loaded in time)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            held = {h.get("preloaded") for h in self.workers().values() if h.get("state") == "standby"}
            for function in functions:
                if function in held:
                    return function
            time.sleep(0.2)
        print(f"no standby pre-loaded any of {functions} within {timeout_s} s; measuring anyway", flush=True)
        return functions[0]

    def status(self, function: str, since_ms: float | None = None, timeout_s: float = 10) -> dict[str, str]:
        """The function's status hash; with `since_ms`, once it records a cold start after then (the
        controller writes it on the round after the worker's `bound` event: the reply can come first)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.redis.hgetall(f"lorafn:fn:{function}:status")
            if since_ms is None or int(status.get("last_cold_at_ms") or 0) >= since_ms:
                return status
            if time.monotonic() > deadline:
                print(f"{function}: no cold start recorded within {timeout_s} s", flush=True)
                return status
            time.sleep(0.1)

    def cold_timeline(self, function: str) -> dict[str, float]:
        """Where the first request of `function` spent its time, on Redis's clock (entry ids are server
        time): demand record -> the controller's bind command -> the worker's `accepted` reply -> the first
        text delta (`request_to_bind_ms`, `bind_to_accepted_ms`, `accepted_to_first_delta_ms`)."""
        from lorafn.store import Keys

        keys, out = Keys("lorafn"), {}
        demand = [
            int(f["at"]) for _id, f in self.redis.xrange(keys.demand()) if f.get("function") == function
        ]
        wid, bind_ms = None, None
        for w, h in self.workers().items():
            if h.get("function") != function:
                continue
            wid = wid or w
            for entry_id, body in self.redis.xrange(keys.control(w)):
                if body.get("cmd") == "bind" and body.get("function") == function:
                    wid, bind_ms = w, int(entry_id.split("-")[0])
        if not demand or wid is None:
            return out
        # a standby that took the request itself (a claiming pre-load) got no bind command before it; one
        # the controller sent in the race came after the worker's `accepted` and is not the cold start's
        start = min(demand)
        for key in self.redis.scan_iter(f"{keys.prefix}:reply:*"):
            events = [(int(i.split("-")[0]), " ".join(f.values())) for i, f in self.redis.xrange(key)]
            if events and str(wid) in events[0][1] and '"accepted"' in events[0][1]:
                first = next((t for t, e in events if '"delta"' in e), None)
                if bind_ms is not None and bind_ms <= events[0][0]:
                    out["request_to_bind_ms"] = float(bind_ms - start)
                    out["bind_to_accepted_ms"] = float(events[0][0] - bind_ms)
                else:
                    out["request_to_accepted_ms"] = float(events[0][0] - start)
                if first is not None:
                    out["accepted_to_first_delta_ms"] = float(first - events[0][0])
        return out

    def stop(self) -> None:
        # SIGTERM, as `lorafn down` (and the replay's ManagedPlatform.stop) send: a bench started from a
        # background job of a shell without job control runs `up` with SIGINT ignored
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--preset", default=None, help="write this random preset into --workdir first")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--standby-repeats",
        type=int,
        default=3,
        help="standby cold starts to measure (one function each, the median is the row)",
    )
    ap.add_argument("--density", type=int, default=0, help="also: invoke N small functions at once")
    ap.add_argument("--kv-mib", type=int, default=64, help="KV budget of each density function")
    ap.add_argument("--density-timeout", type=float, default=180, help="seconds each density request waits")
    ap.add_argument(
        "--overhead-mib",
        type=int,
        default=1024,
        help="the controller's per-worker overhead (CUDA context etc.)",
    )
    ap.add_argument("--skip-no-share", action="store_true")
    ap.add_argument(
        "--same-prompt",
        action="store_true",
        help="send one prompt every time (default: each timed request a new length near --prompt-tokens)",
    )
    ap.add_argument(
        "--no-claims",
        action="store_true",
        help="pre-loaded standbys wait for the controller's bind (`preload_claims: false`: the before row)",
    )
    ap.add_argument("--density-only", action="store_true", help="skip the warm/standby/fresh rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lorafn-coldstart-"))
    workdir.mkdir(parents=True, exist_ok=True)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    model = args.model
    if model is None:
        from lorafn.models.random_model import write_random_model

        model = write_random_model(
            args.preset or "tiny", workdir / "model", seed=0, dtype=dtype, progress=False
        )
    from lorafn.runtime.config import ModelConfig
    from lorafn.runtime.lora import write_random_adapter

    mc = ModelConfig.from_dir(model)
    adapters = [
        write_random_adapter(mc, workdir / f"adapter{i}", rank=args.rank, seed=i, target_modules="all-linear")
        for i in range(3)
    ]
    # one function per standby cold start (each function's first request is the only cold one); the
    # first measured (whichever a standby pre-loads first) gives the warm rows
    cold_fns = ["warmfn"] + [f"coldfn{i}" for i in range(1, max(1, args.standby_repeats))]
    cold_adapters = [adapters[0]] + [
        write_random_adapter(
            mc, workdir / f"adapter_c{i}", rank=args.rank, seed=100 + i, target_modules="all-linear"
        )
        for i in range(1, len(cold_fns))
    ]
    prompt = prompt_of(args.prompt_tokens)
    lengths = iter(range(args.prompt_tokens + 1, args.prompt_tokens + 10_000))

    def next_prompt() -> str:
        # every timed request a length no worker of the run has seen (unless --same-prompt): a first
        # request of a length pays one-time costs (kernel choices, allocator growth) that a repeat of the
        # same prompt hides, and a standby's cold request always pays them; warm repeats of one prompt
        # would be measured without them
        return prompt if args.same_prompt else prompt_of(next(lengths))

    results: dict[str, Any] = {"model": str(model), "device": args.device, "rank": args.rank}
    if args.device == "cuda":
        config = f"gateway_port: 0\nworker_overhead_mib: {args.overhead_mib}\ndefault_kv_mib: 2048\n"
    else:
        config = "gateway_port: 0\ndevices: 1\ndevice_memory_mib: 4096\n"
    if args.no_claims:
        config += "preload_claims: false\n"
    platform = Platform(workdir, args.device, config)
    try:
        platform.apply(backbone_doc("pooled", model, dtype, 1, 2), None, workdir, "bb1")
        if args.density_only:
            cold_fns, cold_adapters = cold_fns[:1], cold_adapters[:1]
        for i, (name, adapter) in enumerate(zip(cold_fns, cold_adapters, strict=True)):
            platform.apply(function_doc(name, "pooled", adapter), f"k-{name}", workdir, f"f1_{i}")
        if not args.density_only:  # a second backbone (its own copy on the GPU) without a warm pool
            platform.apply(backbone_doc("nopool", model, dtype, 0, 0), None, workdir, "bb2")
            platform.apply(function_doc("freshfn", "nopool", adapters[1]), "k-fresh", workdir, "f2")
        from lorafn.api.adapters import validate_adapter

        shape = validate_adapter(adapters[0], model).shape_key
        url = platform.state["gateway_url"]
        rows: dict[str, dict[str, Any]] = {}
        if not args.density_only:
            # first: a fresh start (its own backbone, no pool), once the pool is up and quiet; it also runs
            # the client's first streamed request (lazy imports and set-up in the `openai` package: ~10 ms
            # once per process, which the first timed standby request would otherwise carry)
            platform.wait_standby("pooled", shape)
            platform.wait_pool_settled("pooled")
            up_cpu = cpu_ms(platform.proc.pid)
            sent_ms = time.time() * 1000
            t, rid = ttft_ms(url, "k-fresh", "bench/freshfn", next_prompt(), args.max_tokens, 600)
            rows["fresh"] = {
                "ttft_ms": t,
                "rid": rid,
                "up_cpu_ms": cpu_ms(platform.proc.pid) - up_cpu,
                **platform.status("bench/freshfn", since_ms=sent_ms),
            }
            print("fresh", rows["fresh"], flush=True)
            # the first one's worker then gives the warm requests; after each later cold start, one warm
            # request at once: a pair measured under the same conditions (the GPU's speed drifts between
            # runs and within one: warm prefills of 25-35 ms in one run, 40-52 ms in the next)
            samples, pairs, remaining = [], [], [f"bench/{n}" for n in cold_fns]
            warm_fn = ""
            while remaining:
                # the pool's refill after the previous bind warms up (forward passes, graphs): let it finish
                # and pre-load a function, or it runs beside the request and inflates it
                platform.wait_standby("pooled", shape)
                platform.wait_pool_settled("pooled")
                name = platform.wait_preloaded(remaining).split("/", 1)[1]
                remaining.remove(f"bench/{name}")
                up_cpu, sent_ms = cpu_ms(platform.proc.pid), time.time() * 1000
                t, rid = ttft_ms(url, f"k-{name}", f"bench/{name}", next_prompt(), args.max_tokens, 600)
                sample = {
                    "function": name,
                    "ttft_ms": t,
                    "rid": rid,
                    "up_cpu_ms": cpu_ms(platform.proc.pid) - up_cpu,
                    **platform.cold_timeline(f"bench/{name}"),
                    **platform.status(f"bench/{name}", since_ms=sent_ms),
                }
                warm_fn = warm_fn or name  # the first one's worker gives the warm requests
                if name != warm_fn:
                    w, _ = ttft_ms(
                        url, f"k-{warm_fn}", f"bench/{warm_fn}", next_prompt(), args.max_tokens, 600
                    )
                    sample["paired_warm_ms"] = w
                    pairs.append((t, w))
                print("standby", sample, flush=True)
                samples.append(sample)
            middle = sorted(samples, key=lambda x: x["ttft_ms"])[len(samples) // 2]
            rows["standby"] = {**middle, "all_ms": [x["ttft_ms"] for x in samples], "samples": samples}
            if pairs:
                rows["standby"]["paired_ratio_median"] = statistics.median(c / w for c, w in pairs)
                rows["standby"]["paired_warm_median_ms"] = statistics.median(w for _, w in pairs)
            platform.wait_standby("pooled", shape)
            platform.wait_pool_settled("pooled")
            up_cpu = cpu_ms(platform.proc.pid)
            warm = [
                ttft_ms(url, f"k-{warm_fn}", f"bench/{warm_fn}", next_prompt(), args.max_tokens, 600)
                for _ in range(args.repeats)
            ]
            warm_up_cpu = (cpu_ms(platform.proc.pid) - up_cpu) / args.repeats
            median = sorted(warm)[len(warm) // 2]
            rows["warm"] = {
                "ttft_ms": statistics.median(t for t, _ in warm),
                "all_ms": [t for t, _ in warm],
                "rid": median[1],
                "up_cpu_ms": warm_up_cpu,
            }
            print("warm", rows["warm"], flush=True)
            if not args.same_prompt:  # the same warm worker, one prompt repeated: what repeats hide
                again = [
                    ttft_ms(url, f"k-{warm_fn}", f"bench/{warm_fn}", prompt, args.max_tokens, 600)
                    for _ in range(args.repeats)
                ]
                rows["warm-same"] = {
                    "ttft_ms": statistics.median(t for t, _ in again),
                    "all_ms": [t for t, _ in again],
                    "rid": sorted(again)[len(again) // 2][1],
                }
                print("warm-same", rows["warm-same"], flush=True)
        if args.density:
            rows["density"] = density(platform, workdir, adapters[2], args, prompt)
    finally:
        platform.stop()
    for row in rows.values():  # the processes' own lines, complete once they stopped
        for r in [row, *row.get("samples", [])]:
            if r.get("rid"):
                r.update(request_stages(platform.state_dir / "logs", r["rid"]))
    if not args.skip_no_share and not args.density_only:
        rows["no-share"] = {"ttft_ms": no_share_ms(model, adapters[0], args.device, prompt)}
    results["rows"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    w = rows["warm"]["ttft_ms"] if "warm" in rows else float("nan")
    print(
        f"\ncold start, {args.device}, {model.name}, r{args.rank} all-linear, "
        f"prompt {args.prompt_tokens} tokens"
    )
    print(f"{'path':<10}{'TTFT ms':>12}{'x warm':>9}{'controller ms':>15}{'request->bind':>15}  how")
    for name in ("warm", "warm-same", "standby", "fresh", "no-share"):
        if name not in rows:
            continue
        r = rows[name]
        ctl = r.get("last_cold_start_ms", "")
        to_bind = r.get("request_to_bind_ms")
        how = (
            r.get("last_cold_path", "")
            + (", adapter pre-loaded" if r.get("last_cold_preloaded") == "1" else "")
            + (", took the request itself" if r.get("last_cold_claimed") == "1" else "")
        )
        print(
            f"{name:<10}{r['ttft_ms']:>12.1f}{r['ttft_ms'] / w:>9.2f}{ctl:>15}"
            f"{'' if to_bind is None else f'{to_bind:.0f} ms':>15}  {how}"
        )
    if "standby" in rows:
        st = rows["standby"]
        parts = (
            "request_to_bind_ms",
            "bind_to_accepted_ms",
            "request_to_accepted_ms",
            "accepted_to_first_delta_ms",
        )
        print(
            "standby timeline (Redis clock): "
            + ", ".join(f"{k.removesuffix('_ms').replace('_', ' ')} {st[k]:.0f} ms" for k in parts if k in st)
        )
    print(stage_table(rows))
    st = rows.get("standby", {})
    if "paired_ratio_median" in st:
        print(
            f"paired: each later standby cold start then one warm request at once: warm median "
            f"{st['paired_warm_median_ms']:.1f} ms, standby / warm per pair: median "
            f"{st['paired_ratio_median']:.2f} ("
            + ", ".join(
                f"{x['ttft_ms'] / x['paired_warm_ms']:.2f}" for x in st["samples"] if "paired_warm_ms" in x
            )
            + ")"
        )
    for sample in rows.get("standby", {}).get("samples", []):
        print(
            f"standby sample {sample['function']}: TTFT {sample['ttft_ms']:.1f} ms, "
            f"worker queued {sample.get('wk_queued_ms', float('nan')):.1f} ms, "
            f"prefill {sample.get('wk_prefill_ms', float('nan')):.1f} ms, "
            f"claimed {sample.get('last_cold_claimed', '?')}, "
            f"pre-loaded {sample.get('last_cold_preloaded', '?')}"
        )
    print("target (issue 10): standby cold start <= 1.15 x warm TTFT")
    if "density" in rows:
        d = rows["density"]
        print(
            f"\ndensity: {d['bound']} of {d['asked']} functions bound at once on one GPU "
            f"(KV {args.kv_mib} MiB each); GPU memory per bound function beyond the backbones: "
            f"{d['per_function_mib']:.0f} MiB (target: >= 100 functions, <= 400 MiB each); "
            f"workers' own reports (driver): median {d['reported_mib_median']} MiB, "
            f"max {d['reported_mib_max']} MiB"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


GATEWAY_STAGES = MARKS  # the gateway's request-line marks, in the order they happen
WORKER_STAGES = ("queued", "held", "prefill", "first_token", "gc")


def stage_table(rows: dict[str, dict[str, Any]]) -> str:
    """Each row's request as its processes logged it: the gateway's stages (ms since it received the
    request) and the worker's (queued = enqueued -> read, held = read -> first step, prefill = that step
    -> first token, first token = enqueued -> first delta sent, gc = the garbage collector's time while the
    request ran); the client's TTFT beside them; `up cpu`: CPU ms the `lorafn up` process (supervisor,
    controller rounds) used during the request (the warm row: per request)."""
    names = [n for n in ("warm", "warm-same", "standby", "fresh") if n in rows and "gw_done_ms" in rows[n]]
    if not names:
        return "(no per-request lines found in the logs)"
    cols = [f"gw {s}" for s in GATEWAY_STAGES] + [f"wk {s}" for s in WORKER_STAGES] + ["up cpu"]
    lines = [
        "per-request stages (ms; gateway: since received; worker: see bench docstring)",
        f"{'path':<10}{'client':>8}" + "".join(f"{c:>15}" for c in cols),
    ]
    for n in names:
        r = rows[n]
        vals = [r.get(f"gw_{s}_ms") for s in GATEWAY_STAGES] + [r.get(f"wk_{s}_ms") for s in WORKER_STAGES]
        vals.append(r.get("up_cpu_ms"))
        lines.append(
            f"{n:<10}{r['ttft_ms']:>8.1f}" + "".join(f"{'' if v is None else f'{v:.1f}':>15}" for v in vals)
        )
    return "\n".join(lines)


def density(
    platform: Platform, workdir: Path, adapter: Path, args: argparse.Namespace, prompt: str
) -> dict[str, Any]:
    """N functions with a small KV budget, all invoked at once; how many get a worker on the GPU."""
    before = gpu_used_bytes()
    names = [f"d{i:03d}" for i in range(args.density)]

    def apply(name: str) -> None:
        doc = function_doc(name, "pooled", adapter, f", resources: {{kvCacheMiB: {args.kv_mib}}}")
        platform.apply(doc, f"k-{name}", workdir, name)

    with ThreadPoolExecutor(max_workers=8) as pool:  # one `lorafn apply` each (a key per function)
        list(pool.map(apply, names))
    url = platform.state["gateway_url"]

    errors: dict[str, int] = {}
    messages: list[str] = []

    def call(name: str) -> bool:
        """Answered (any text, even empty: a random model may emit tokens that decode to nothing)."""
        from openai import OpenAI

        client = OpenAI(
            base_url=f"{url}/v1", api_key=f"k-{name}", timeout=args.density_timeout, max_retries=0
        )
        try:
            client.completions.create(model=f"bench/{name}", prompt=prompt[:200], max_tokens=2, temperature=0)
            return True
        except Exception as e:
            kind = type(e).__name__
            status = getattr(e, "status_code", None)
            if status is not None:
                kind = f"{kind}({status})"
            errors[kind] = errors.get(kind, 0) + 1
            if len(messages) < 20:  # what the client was told (a 5xx must not happen: find out why)
                messages.append(f"{name}: {kind}: {str(e)[:300]}")
            return False

    with ThreadPoolExecutor(max_workers=min(128, args.density)) as pool:
        ok = list(pool.map(call, names))
    print(f"density: {sum(ok)} of {len(names)} answered; errors {errors}", flush=True)
    for m in messages:
        print(f"  {m}", flush=True)
    bound = [h for h in platform.workers().values() if h.get("function", "").startswith("bench/d")]
    after = gpu_used_bytes()
    per = ((after or 0) - (before or 0)) / MiB / max(1, len(bound))
    # each worker's own figure (the driver's count of its process, the controller's learning input)
    reported = [int(h["mem_bytes"]) / MiB for h in bound if h.get("mem_source") == "driver"]
    return {
        "asked": args.density, "answered": sum(ok), "errors": errors, "error_messages": messages,
        "bound": len(bound),
        "per_function_mib": per, "gpu_used_before": before, "gpu_used_after": after,
        "reported_mib_median": statistics.median(reported) if reported else None,
        "reported_mib_max": max(reported) if reported else None,
    }  # fmt: skip


if __name__ == "__main__":
    main()
