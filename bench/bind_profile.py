"""Where a standby's cold start goes, two parts:

1. `--model`: cProfile of `Engine.bind_adapter` into prepared buffers (and a second bind of the same adapter
   into a second standby engine, with the process warm), and a bind whose adapter was pre-loaded (the copy
   done before the request: what is left is what the standby does at bind time), on the given model.

       python bench/bind_profile.py --model /tmp/llama-2-7b --device cuda

2. `--demand`: request -> bind command latency of the controller, on CPU, side by side in one run: the
   gateway's demand record (Redis) to the `bind` entry on a standby's control stream (both timestamps on
   Redis's clock), with the fast path off (the loop wakes on demand and runs a full round: what `lorafn up`
   did before) and on (`Controller.answer_demand` binds from the last snapshot, then the full round). A real
   redis-server and the real `Controller` (its loop as `lorafn up`'s tick runs it); the standbys are
   heartbeats written by this bench (no worker processes), `--functions` registered functions with real
   adapter files (the tiny preset), demand recorded at a random moment of the loop.

       python bench/bind_profile.py --demand [--repeats 40] [--functions 50]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 1 << 20


def profile_bind(args: argparse.Namespace) -> None:
    from lorafn.api.adapters import validate_adapter
    from lorafn.runtime import Engine, EngineConfig
    from lorafn.runtime.config import ModelConfig
    from lorafn.runtime.lora import copy_lora, load_lora, write_random_adapter

    work = Path(tempfile.mkdtemp())
    adapter = write_random_adapter(ModelConfig.from_dir(args.model), work / "a", rank=args.rank)
    shape = validate_adapter(adapter, args.model).shape_key

    def standby() -> Engine:
        return Engine(EngineConfig(model=args.model, lora_shape=shape, device=args.device, num_kv_blocks=512))

    t0 = time.perf_counter()
    engine = standby()
    print(f"standby engine built in {time.perf_counter() - t0:.1f} s", flush=True)
    for attempt in ("first bind (cold page cache for the adapter file)", "second bind (same file, warm)"):
        if attempt.startswith("second"):
            engine = standby()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        how = engine.bind_adapter(adapter)
        prof.disable()
        print(f"{attempt}: {1000 * (time.perf_counter() - t0):.1f} ms ({how})", flush=True)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
    engine = standby()
    runner = engine.runner
    t0 = time.perf_counter()
    copy_lora(runner.lora, load_lora(adapter, runner.model_config, runner.device, runner.dtype))
    preload_ms = 1000 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    runner.prepared = False  # what `Standby._bind` does with a pre-loaded adapter
    print(
        f"pre-loaded: the load before the request {preload_ms:.1f} ms; at bind "
        f"{1000 * (time.perf_counter() - t0):.3f} ms (+ the registration read, one Redis round trip)"
    )


class _Executor:
    """One simulated GPU holding the backbone; starts nothing (the bench's standbys are heartbeats)."""

    def __init__(self, backbone: str, backbone_bytes: int) -> None:
        self.backbone, self.backbone_bytes = backbone, backbone_bytes

    def gpus(self) -> list[Any]:
        from lorafn.controller.policy.model import GPU

        return [GPU("g0", "n0", 80 << 30, {self.backbone: self.backbone_bytes})]

    def start(self, action: Any, worker_id: str) -> None:
        pass

    def stop(self, worker_id: str) -> None:
        pass

    def starting(self) -> list[Any]:
        return []

    def exits(self) -> list[Any]:
        return []


def demand_latency(args: argparse.Namespace) -> None:
    from lorafn.api.adapters import validate_adapter
    from lorafn.local.redis_proc import RedisProcess
    from lorafn.models.random_model import write_random_model
    from lorafn.runtime.config import ModelConfig
    from lorafn.runtime.lora import write_random_adapter
    from lorafn.store import Keys, Store

    work = Path(tempfile.mkdtemp(prefix="lorafn-bindlat-"))
    model = write_random_model("tiny", work / "model", seed=0, dtype="float32", progress=False)
    adapter = write_random_adapter(
        ModelConfig.from_dir(model), work / "a", rank=4, target_modules="all-linear"
    )
    shape = validate_adapter(adapter, model).shape_key
    server = RedisProcess(data_dir=work / "redis").start()
    rows: dict[str, list[float]] = {}
    try:
        for label, fast in (
            ("before: wake, full round", False),
            ("after: fast path from the snapshot", True),
        ):
            store, keys = Store(server.url), Keys(f"b{int(fast)}")
            rows[label] = _measure(args, store, keys, model, adapter, shape, fast)
            store.close()
    finally:
        server.stop()
    print(
        f"\nrequest -> bind command (demand record to the control entry, Redis clock), CPU, "
        f"{args.functions} functions, {args.standbys} standbys, {args.repeats} cold starts per row"
    )
    print(f"{'controller loop':<38}{'p50 ms':>9}{'p90 ms':>9}{'max ms':>9}")
    for label, ms in rows.items():
        q = statistics.quantiles(ms, n=10) if len(ms) >= 2 else ms * 9
        print(f"{label:<38}{statistics.median(ms):>9.1f}{q[-1]:>9.1f}{max(ms):>9.1f}")


def _measure(
    args: argparse.Namespace, store: Any, keys: Any, model: Path, adapter: Path, shape: str, fast: bool
) -> list[float]:
    from lorafn.controller.driver import Controller, ControllerConfig
    from lorafn.controller.policy.config import PolicyConfig
    from lorafn.controller.snapshot import default_sizing
    from lorafn.store import streams, workers
    from lorafn.store.backbones import BackboneRecord, put_backbone
    from lorafn.store.protocol import RequestBody
    from lorafn.store.registry import FunctionRecord, put_function

    spec_bb = {"model": {"uri": f"file://{model}"}, "warmPool": {"minStandby": 0, "maxStandby": 64}}
    store.run(put_backbone(keys, BackboneRecord("tiny", str(model), "float32", spec_bb)))
    names = [f"bench/f{i:03d}" for i in range(args.functions)]
    for name in names:
        spec = {
            "backbone": "tiny",
            "adapter": {"uri": f"file://{adapter}"},
            "scaling": {"keepAliveSeconds": 3600},
        }
        store.run(put_function(keys, FunctionRecord(name, spec, str(model), str(adapter))))
    controller = Controller(
        store, keys, _Executor("tiny", 0), default_sizing("cpu"),
        ControllerConfig(
            holder=f"bench-{int(fast)}", fast_bind=fast, policy=PolicyConfig(pool_min_age_s=3600)
        ),
    )  # fmt: skip
    standby_ids: list[str] = []
    bound: dict[str, str] = {}  # worker id -> function (after its bind)
    lock, stop = threading.Lock(), threading.Event()
    counter = [0]

    def new_standby() -> None:
        counter[0] += 1
        standby_ids.append(f"s{int(fast)}-{counter[0]}")

    for _ in range(args.standbys):
        new_standby()

    def beat() -> None:  # the standbys' and bound workers' heartbeats (what the worker processes send)
        started = int(time.time())
        while not stop.is_set():
            with lock:
                beats = [(w, None) for w in standby_ids] + list(bound.items())
            for wid, function in beats:
                fields = {
                    "state": "serving" if function else "standby", "gpu": "g0", "backbone": "tiny",
                    "shape": shape, "mem_bytes": 96 * MiB, "running": 0, "started": started,
                }  # fmt: skip
                store.run(workers.heartbeat(keys, wid, function, 5000, fields))
            stop.wait(0.2)

    def loop() -> None:  # `lorafn up`'s tick, less the process supervision: wait, answer, round
        controller.round()
        while not stop.is_set():
            demand = controller.wait_for_demand(0.5)
            controller.answer_demand(demand)
            controller.round()

    threads = [threading.Thread(target=beat, daemon=True), threading.Thread(target=loop, daemon=True)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # a few rounds: the pool and pre-loads settle
    rng = random.Random(0)
    out: list[float] = []
    for name in names[: args.repeats]:
        time.sleep(rng.uniform(0.05, 0.6))  # demand lands anywhere in the loop's cycle
        # what the gateway does for a request that finds no live worker: queue it, record demand
        store.run(
            streams.admit(
                keys, name, f"r{counter[0]}-{name[-3:]}", RequestBody(prompt="hello"), deadline_ms=0,
                now_s=time.time(), rate_limit_rps=0.0, rate_limit_burst=1, heartbeat_ttl_ms=5000,
            )
        )  # fmt: skip
        entry = store.run(streams.record_demand(keys, name, "request", 1))
        at_ms = int(str(entry).split("-", 1)[0])
        deadline = time.monotonic() + 10
        found = None
        while found is None and time.monotonic() < deadline:
            with lock:
                candidates = list(standby_ids)
            for wid in candidates:
                for entry_id, body in store.run(workers.read_control(keys, wid, "0-0")):
                    if body.get("cmd") == "bind" and body.get("function") == name:
                        found = (wid, int(entry_id.split("-", 1)[0]))
            if found is None:
                time.sleep(0.001)
        if found is None:
            print(f"  {name}: no bind within 10 s", flush=True)
            continue
        wid, bind_ms = found
        out.append(float(bind_ms - at_ms))
        with lock:  # the standby becomes that function's worker; the pool gets a fresh one
            standby_ids.remove(wid)
            bound[wid] = name
            new_standby()
    stop.set()
    for t in threads:
        t.join(timeout=5)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--demand", action="store_true", help="the controller's request -> bind latency (CPU)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--functions", type=int, default=50)
    ap.add_argument("--standbys", type=int, default=4)
    args = ap.parse_args()
    if args.demand:
        args.functions = max(args.functions, args.repeats)
        demand_latency(args)
    elif args.model is not None:
        profile_bind(args)
    else:
        ap.error("give --model (bind profile) or --demand (controller latency)")


if __name__ == "__main__":
    main()
