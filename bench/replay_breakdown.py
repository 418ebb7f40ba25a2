"""Where the late requests of one `lorafn bench replay` configuration spent their time (issue 16).

Reads a replay output directory (``replay.json``, ``runs/<config>/up.log``, ``runs/<config>/logs/``) and
joins, by request id and worker id, the client's records, the gateway's request lines (arrival =
log time - done_ms), the controller's decisions in up.log (start / bind / offload stop / exit) and each
worker's log (start-up stages, per-request queued/held/prefill). It prints:

1. late requests (TTFT > SLO) by path, each one's TTFT cut into consecutive phases of the worker that
   served it: waiting for the controller's decision, spawn (decision -> engine build begins: fork +
   imports), engine pre-runner (CUDA context + backbone attach + tokenizer: `SharedWeightSource`, not
   in the runner's stages), runner stages (adapter load, views, KV), ready -> read (in the worker's
   queue), held (fill-or-expire / GPU admission), prefill, and the rest (gateway and client);
   for fresh starts, the decision wait split by offload victims (before the first stop, victims exiting);
   the controller's own wait causes (its "wait"/"waited" lines) over each fresh start's decision wait;
2. fresh start-up stages against the number of starts in flight at once;
3. offload churn: victims' idle time, how soon their function came back, repeated cold starts;
4. workers alive (fork -> exit, what the controller's account holds) at each offload, and the sampled
   bound/standby/held memory;
5. decode time per output token against how many functions were generating at once (each function is
   its own worker process, and each worker's decode step reads the whole backbone: TPOT grows with
   the number of functions decoding together, not with one function's batch).

    python3 bench/replay_breakdown.py /tmp/rp-full [--config full] [--slo-ms 2500]

Times are wall-clock seconds from the log lines (one host, millisecond resolution); no GPU needed.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from lorafn.replay.report import decode_concurrency_of

TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
KV = re.compile(r"(\w+)=([^\s]+)")
W = r"(w-local-[\w-]+)"


def ts(line: str) -> float | None:
    m = TS.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


@dataclass
class Worker:
    wid: str
    kind: str = ""  # fresh | standby
    function: str = ""
    decided: float | None = None  # controller's start line
    forked: float | None = None
    built: float | None = None  # engine build begins (start-up line time - engine_ms)
    runner: float | None = None  # ModelRunner begins (its "CUDA stack limit" line)
    ready: float | None = None  # start-up line (fresh) / bind done (standby)
    bind_sent: float | None = None
    stopped: float | None = None
    room_for: str = ""
    exited: float | None = None
    stages: dict[str, float] = field(default_factory=dict)
    requests: list[dict[str, float | str]] = field(default_factory=list)


def parse_up(
    path: Path, workers: dict[str, Worker], waits: dict[str, list[tuple[float, float, str]]]
) -> list[tuple[float, float]]:
    """Controller/executor lines into `workers`, and into `waits` each function's wait segments (start,
    end, cause) from the controller's wait lines (since lorafn.controller.waits; older logs have none);
    returns the fresh-start estimates (time, seconds)."""
    estimates = []
    open_wait: dict[str, tuple[float, str]] = {}
    for line in path.read_text().splitlines():
        t = ts(line)
        if t is None:
            continue
        if m := re.search(r"controller: wait (\S+) \((\w+)[,)]", line):
            if m.group(1) in open_wait:
                since, cause = open_wait[m.group(1)]
                waits.setdefault(m.group(1), []).append((since, t, cause))
            open_wait[m.group(1)] = (t, m.group(2))
        elif m := re.search(r"controller: waited (\S+) ", line):
            if m.group(1) in open_wait:
                since, cause = open_wait.pop(m.group(1))
                waits.setdefault(m.group(1), []).append((since, t, cause))
        elif m := re.search(rf"controller: start {W} on \S+ for (\S+): demand", line):
            w = workers.setdefault(m.group(1), Worker(m.group(1)))
            w.kind, w.function, w.decided = "fresh", m.group(2), t
        elif m := re.search(rf"controller: start {W} on \S+ standby", line):
            w = workers.setdefault(m.group(1), Worker(m.group(1)))
            w.kind, w.decided = "standby", t
        elif m := re.search(rf"worker {W} .* forked from the zygote", line):
            workers.setdefault(m.group(1), Worker(m.group(1))).forked = t
        elif m := re.search(rf"controller: bind {W} -> (\S+)", line):
            w = workers.setdefault(m.group(1), Worker(m.group(1)))
            w.bind_sent = w.bind_sent or t
        elif m := re.search(rf"controller: stop {W} \(offload\) .* makes room for (\S+)", line):
            w = workers.setdefault(m.group(1), Worker(m.group(1)))
            w.stopped, w.room_for = t, m.group(2)
        elif m := re.search(rf"worker {W} exited", line):
            workers.setdefault(m.group(1), Worker(m.group(1))).exited = t
        elif m := re.search(r"fresh start estimate \S+ s -> (\S+) s", line):
            estimates.append((t, float(m.group(1))))
    return estimates


def parse_worker_log(path: Path, workers: dict[str, Worker]) -> None:
    wid = path.stem.removeprefix("worker_")
    w = workers.setdefault(wid, Worker(wid))
    for line in path.read_text().splitlines():
        t = ts(line)
        if t is None:
            continue
        if "CUDA stack limit" in line:
            w.runner = t
        elif "worker start-up" in line:
            w.stages = {k: float(v) for k, v in KV.findall(line)}
            w.ready = t
            w.built = t - w.stages["engine_ms"] / 1000
        elif m := re.search(r"standby \S+ (?:bound to|took the request of) (\S+)", line):
            w.function, w.ready = m.group(1), t
        elif m := re.search(r"worker \S+ serving (\S+)", line):
            w.function = w.function or m.group(1)
        elif " request rid=" in line:
            rec: dict[str, float | str] = dict(KV.findall(line))
            rec["done"] = t
            w.requests.append(rec)


def q(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]


def fmt(xs: list[float]) -> str:
    if not xs:
        return "n=0"
    return f"n={len(xs)} p50={q(xs, 0.5):.0f} p90={q(xs, 0.9):.0f} max={max(xs):.0f} sum={sum(xs):.0f}"


PHASES = ("controller", "spawn", "pre_runner", "runner", "in_queue", "held", "prefill", "rest")


def breakdown(recv: float, ttft_s: float, w: Worker, rec: dict[str, float | str]) -> dict[str, float]:
    """The request's TTFT (s) cut at the serving worker's milestones, each phase clipped to [recv, ...)."""
    read = recv + float(rec["queued_ms"]) / 1000
    held_end = read + float(rec["held_ms"]) / 1000
    first = held_end + float(rec["prefill_ms"]) / 1000
    marks: list[tuple[str, float | None]] = [
        ("controller", w.decided if w.kind == "fresh" else w.bind_sent),
        ("spawn", w.built if w.kind == "fresh" else None),
        ("pre_runner", w.runner if w.kind == "fresh" else None),
        ("runner", w.ready),
        ("in_queue", read),
        ("held", held_end),
        ("prefill", first),
    ]
    out, t = {}, recv
    for name, end in marks:
        end = t if end is None else max(t, min(end, first))
        out[name], t = end - t, end
    out["rest"] = max(0.0, ttft_s - (t - recv))
    return out


def ms(xs: list[float]) -> list[float]:
    return [x * 1000 for x in xs]


def in_flight(starts: list[Worker], t: float) -> int:
    return sum(1 for s in starts if s.decided is not None and s.decided <= t < (s.ready or s.exited or 1e18))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("replay_dir", type=Path)
    ap.add_argument("--config", default=None, help="configuration name (default: the first in replay.json)")
    ap.add_argument("--slo-ms", type=float, default=2500.0)
    ap.add_argument(
        "--cap", type=int, default=6, help="fresh starts per GPU at once (max_fresh_starts_per_gpu)"
    )
    a = ap.parse_args()
    report = json.loads((a.replay_dir / "replay.json").read_text())
    cfg = next(c for c in report["configs"] if a.config in (None, c["config"]))
    run = a.replay_dir / "runs" / cfg["config"]
    workers: dict[str, Worker] = {}
    waits: dict[str, list[tuple[float, float, str]]] = {}
    estimates = parse_up(run / "up.log", workers, waits)
    for p in sorted((run / "logs").glob("worker_*.log")):
        parse_worker_log(p, workers)
    by_rid = {str(r["rid"]): (w, r) for w in workers.values() for r in w.requests}
    recv_at: dict[str, float] = {}
    for line in (run / "logs" / "gateway.log").read_text().splitlines():
        t = ts(line)
        if t is not None and " request rid=" in line:
            f = dict(KV.findall(line))
            recv_at[f["rid"]] = t - float(f.get("done_ms", "0")) / 1000
    window = cfg["requests"]
    offs = [recv_at[r["request_id"]] - r["sent_s"] for r in window if r["request_id"] in recv_at]
    t0 = statistics.median(offs)
    print(f"{cfg['config']}: {len(window)} window requests, t0 = {datetime.fromtimestamp(t0)} (window start)")
    recv_by_fn: dict[str, list[float]] = defaultdict(list)
    for r in cfg["warmup_requests"] + window:
        recv_by_fn[r["function"]].append(t0 + r["sent_s"])
    for v in recv_by_fn.values():
        v.sort()

    # 1. late requests
    print(f"\n1. late requests (TTFT > {a.slo_ms:.0f} ms), TTFT cut into phases (s), by path")
    late = [r for r in window if r.get("ttft_ms") is not None and r["ttft_ms"] > a.slo_ms]
    print(f"   {len(late)} late of {len(window)}; paths {dict(Counter(r['path'] for r in late))}")
    totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    served_by_kind: Counter[str] = Counter()
    for r in late:
        got = by_rid.get(r["request_id"])
        if not got:
            continue
        w, rec = got
        recv = t0 + r["sent_s"]
        waited_start = w.ready is not None and w.ready > recv
        served_by_kind[f"{r['path']}->{w.kind}{'(waited for it)' if waited_start else '(already up)'}"] += 1
        for k, v in breakdown(recv, r["ttft_ms"] / 1000, w, rec).items():
            totals[r["path"]][k].append(v)
            totals["all"][k].append(v)
    print(f"   served by: {dict(served_by_kind)}")
    for path in ("fresh", "queued", "standby"):
        tt = [r["ttft_ms"] for r in window if r["path"] == path and r.get("ttft_ms") is not None]
        if tt:
            print(f"   {path} path, all: {fmt(tt)} ms, late {sum(x > a.slo_ms for x in tt)}")
    for path, ph in totals.items():
        tot = sum(sum(v) for v in ph.values())
        print(
            f"   {path:7s} n={len(ph['prefill']):3d} total {tot:7.1f} s: "
            + "  ".join(
                f"{k} {sum(ph[k]):.1f} ({100 * sum(ph[k]) / tot:.0f}%, p50 {q(ph[k], 0.5):.2f})"
                for k in PHASES
            )
        )

    fresh = sorted((w for w in workers.values() if w.kind == "fresh" and w.decided), key=lambda w: w.decided)
    everyone = list(workers.values())
    # controller wait of each fresh start: the first request it served that arrived before it was ready
    # -> its start decision; split into time with the GPU's start slots full (>= --cap starts in flight),
    # and the part spent on its offload victims (first stop -> last victim exit)
    demand_wait, at_cap, before_stop, victims_exit, after_exit, nvict = [], [], [], [], [], []
    by_cause: Counter[str] = Counter()  # the controller's own wait causes over the same intervals
    for w in fresh:
        asks = [recv_at[str(r["rid"])] for r in w.requests if str(r["rid"]) in recv_at]
        asks = [t for t in asks if w.ready is None or t < w.ready]
        if not asks or min(asks) < t0 or min(asks) > w.decided:
            continue
        ask = min(asks)
        demand_wait.append(w.decided - ask)
        covered = 0.0
        for since, until, cause in waits.get(w.function, []):
            overlap = min(until, w.decided) - max(since, ask)
            if overlap > 0:
                by_cause[cause] += overlap
                covered += overlap
        by_cause["(no wait line)"] += max(0.0, w.decided - ask - covered)
        grid = [ask + i * 0.05 for i in range(int((w.decided - ask) / 0.05))]
        at_cap.append(0.05 * sum(in_flight(everyone, t) >= a.cap for t in grid))
        mine = [
            v
            for v in everyone
            if v.room_for == w.function and v.stopped and ask - 1 <= v.stopped <= w.decided
        ]
        if mine:
            first_stop = min(v.stopped for v in mine)
            last_exit = max((v.exited or w.decided) for v in mine)
            before_stop.append(max(0.0, first_stop - ask))
            victims_exit.append(max(0.0, min(last_exit, w.decided) - first_stop))
            after_exit.append(max(0.0, w.decided - last_exit))
            nvict.append(len(mine))
    print(
        f"\n   window fresh starts, first waiting request -> start decision: {fmt(ms(demand_wait))} ms;"
        f" of it with >= {a.cap} starts in flight: {fmt(ms(at_cap))} ms"
    )
    print(
        f"   {len(nvict)} of them made room by offloading ({sum(nvict)} victims): request -> first stop "
        f"{fmt(ms(before_stop))} ms; first stop -> last victim exit {fmt(ms(victims_exit))} ms;"
        f" last exit -> start {fmt(ms(after_exit))} ms"
    )
    if waits:
        print(
            "   the same intervals by the controller's wait cause (s): "
            + ", ".join(f"{c} {v:.1f}" for c, v in by_cause.most_common())
        )
    stop_to_exit = [1000 * (v.exited - v.stopped) for v in workers.values() if v.stopped and v.exited]
    print(f"   every offload victim, stop -> exit: {fmt(stop_to_exit)} ms")

    # 2. start-up stages vs starts in flight
    print("\n2. fresh start-up stages (ms) by starts in flight at the decision (this one included)")
    groups: dict[str, list[Worker]] = defaultdict(list)
    for w in fresh:
        if not w.stages:
            continue
        n = in_flight(list(workers.values()), w.decided)
        groups["1-2" if n <= 2 else "3-4" if n <= 4 else "5-6" if n <= 6 else "7+"].append(w)
    for g in ("1-2", "3-4", "5-6", "7+"):
        ws = groups.get(g, [])
        if not ws:
            continue
        cols = {
            "decision->built": [1000 * (w.built - w.decided) for w in ws],
            "before_engine": [w.stages.get("before_engine_ms", 0) for w in ws],
            "pre_runner": [1000 * (w.runner - w.built) for w in ws if w.runner],
            # the split of pre_runner, logged by workers from 003c706 on (absent in older logs: empty)
            **{
                name: [w.stages[f"{name}_ms"] for w in ws if f"{name}_ms" in w.stages]
                for name in ("cuda_context", "backbone_attach", "backbone_map")
            },
            "context": [w.stages["context_ms"] for w in ws],
            "adapter": [w.stages["adapter_ms"] for w in ws],
            "backbone": [w.stages["backbone_ms"] for w in ws],
            "kv_cache": [w.stages["kv_cache_ms"] for w in ws],
            "engine": [w.stages["engine_ms"] for w in ws],
            "decision->ready": [1000 * (w.ready - w.decided) for w in ws],
        }
        print(
            f"   in flight {g}: n={len(ws)}  "
            + "  ".join(f"{k} {q(v, 0.5):.0f}/{q(v, 0.9):.0f}" for k, v in cols.items() if v)
        )
    print(
        "   (p50/p90; pre_runner = engine build begins -> ModelRunner: CUDA context, backbone attach,"
        " tokenizer)"
    )
    # what a start overlapped: requests being served on the GPU (read -> done, all workers), on average
    serving = [
        (float(r["done"]) - (float(r["total_ms"]) - float(r["queued_ms"])) / 1000, float(r["done"]))
        for w in everyone
        for r in w.requests
    ]
    load: dict[str, list[Worker]] = defaultdict(list)
    for w in fresh:
        if w.stages and w.built and w.ready and w.ready > w.built:
            n = sum(max(0.0, min(e, w.ready) - max(b, w.built)) for b, e in serving) / (w.ready - w.built)
            load[
                "0-2" if n < 2 else "2-5" if n < 5 else "5-10" if n < 10 else "10-20" if n < 20 else "20+"
            ].append(w)
    for g in ("0-2", "2-5", "5-10", "10-20", "20+"):
        ws = load.get(g, [])
        if ws:
            print(
                f"   requests running during the start {g:5s}: n={len(ws):3d}"
                f"  adapter p50 {q([w.stages['adapter_ms'] for w in ws], 0.5):.0f}"
                f"  pre_runner p50 {q([1000 * (w.runner - w.built) for w in ws if w.runner], 0.5):.0f}"
                f"  engine p50 {q([w.stages['engine_ms'] for w in ws], 0.5):.0f} ms"
            )
    print(f"   fresh start estimates the controller learned: {[round(e, 1) for _, e in estimates]}")
    starting_at_fork = [in_flight(list(workers.values()), w.decided) for w in fresh]
    if starting_at_fork:  # (a run with no fresh start in its window, e.g. functions joining slot workers)
        print(
            f"   starts in flight at each decision: max {max(starting_at_fork)}, "
            f"distribution {sorted(Counter(starting_at_fork).items())}"
        )

    # 3. offload churn
    print("\n3. offload churn")
    victims = [w for w in workers.values() if w.stopped]
    back, idle = [], []
    for v in victims:
        nxt = [t for t in recv_by_fn.get(v.function, []) if t > v.stopped]
        back.append(nxt[0] - v.stopped if nxt else float("inf"))
        last_done = max((float(r["done"]) for r in v.requests), default=None)
        if last_done:
            idle.append(v.stopped - last_done)
    win = [b for v, b in zip(victims, back, strict=True) if v.stopped >= t0]
    finite = [b for b in win if b != float("inf")]
    print(
        f"   offload stops: {len(victims)} ({len(win)} in the window);"
        f" victims' idle time at stop: {fmt(idle)} s"
    )
    print(
        f"   window victims' function back after: {fmt(finite)} s; never back {len(win) - len(finite)}; "
        + ", ".join(f"<{h}s {sum(b < h for b in win)}" for h in (5, 10, 30, 60))
    )
    restarts = []
    for w in fresh:
        if w.decided >= t0:
            gone = [v.stopped for v in victims if v.function == w.function and v.stopped < w.decided]
            restarts.append(w.decided - max(gone) if gone else None)
    print(
        f"   window fresh starts {len(restarts)}: of a function offloaded earlier"
        f" {sum(r is not None for r in restarts)},"
        f" within 30 s {sum(r is not None and r < 30 for r in restarts)},"
        f" within 60 s (its keep-alive) {sum(r is not None and r < 60 for r in restarts)}"
    )
    # the victims an online rule would have picked among the idle bound workers at each offload round,
    # and when their functions came back (a counterfactual on the same arrivals: no second-order effects)
    rounds: dict[int, list[Worker]] = defaultdict(list)
    for v in victims:
        rounds[round(v.stopped)].append(v)
    picks: dict[str, list[float]] = defaultdict(list)
    for vs in rounds.values():
        t = min(v.stopped for v in vs)
        cands = []
        for w in everyone:
            if not (w.function and w.ready and w.ready <= t) or (w.exited and w.exited < t):
                continue
            if (w.stopped and w.stopped < t - 0.5) or any(
                float(r["done"]) - float(r["total_ms"]) / 1000 <= t <= float(r["done"]) for r in w.requests
            ):
                continue
            last = max([float(r["done"]) for r in w.requests if float(r["done"]) <= t] or [w.ready])
            seen = sum(1 for x in recv_by_fn[w.function] if x < t)
            nxt = [x - t for x in recv_by_fn[w.function] if x > t]
            cands.append((t - last, seen, nxt[0] if nxt else float("inf")))
        k = len(vs)
        picks["actual"] += [next((x - t for x in recv_by_fn[v.function] if x > t), float("inf")) for v in vs]
        picks["longest idle"] += [c[2] for c in sorted(cands, key=lambda c: -c[0])[:k]]
        picks["fewest arrivals so far"] += [c[2] for c in sorted(cands, key=lambda c: (c[1], -c[0]))[:k]]
        picks["oracle (back last)"] += [c[2] for c in sorted(cands, key=lambda c: -c[2])[:k]]
    for name, b in picks.items():
        print(
            f"   victims by {name:22s}: back <10s {sum(x < 10 for x in b):3d},"
            f" <30s {sum(x < 30 for x in b):3d},"
            f" <60s {sum(x < 60 for x in b):3d}, never {sum(x == float('inf') for x in b):3d} (of {len(b)})"
        )
    for h in (30, 60):
        ws = [
            len({f for f, ts_ in recv_by_fn.items() if any(t - h <= x < t for x in ts_)})
            for t in [t0 + i for i in range(0, 180, 2)]
        ]
        print(
            f"   working set: distinct functions called in the last {h} s, over the window: "
            f"p50 {q(ws, 0.5)} max {max(ws)}"
        )
    cold_starts = Counter(
        w.function
        for w in workers.values()
        if w.function
        and (w.decided or w.bind_sent)
        and (w.decided or w.bind_sent or 0) >= t0
        and (w.kind == "fresh" or w.bind_sent)
    )
    multi = {f: n for f, n in cold_starts.items() if n > 1}
    print(
        f"   window cold starts (fresh + binds): {sum(cold_starts.values())}"
        f" over {len(cold_starts)} functions; {len(multi)} functions started more than once"
        f" ({sum(multi.values())} starts), max {max(multi.values(), default=0)}"
    )

    # 4. workers alive vs memory
    print("\n4. workers alive (fork -> exit) at each offload stop, and the sampled series")
    alive = [
        sum(1 for w in workers.values() if w.forked and w.forked <= v.stopped < (w.exited or 1e18))
        for v in victims
    ]
    print(f"   alive at an offload: {fmt(alive)}")
    s = cfg["series"]
    pts = [
        (t, b, sb, h)
        for t, b, sb, h in zip(s["t_s"], s["bound"], s["standby"], s["held_mib"], strict=True)
        if t >= 0
    ]
    bound, standby, held = ([p[k] for p in pts] for k in (1, 2, 3))
    print(
        f"   window samples: bound p50 {q(bound, 0.5)} max {max(bound)}; standby p50 {q(standby, 0.5)}"
        f" max {max(standby)}; held GiB p50 {q(held, 0.5) / 1024:.1f} max {max(held) / 1024:.1f};"
        f" samples with 0 standby {standby.count(0)}/{len(pts)}"
    )
    per = [
        w / (b + sb)
        for w, b, sb in zip(s["worker_mib"], s["bound"], s["standby"], strict=True)
        if b + sb >= 10
    ]
    if per:
        print(f"   per-worker MiB (NVML whole process / bound) p50 {q(per, 0.5):.0f} max {max(per):.0f}")

    # 5. decode time against the functions decoding at once
    print("\n5. TPOT by the number of functions generating tokens at once (at the middle of each decode)")
    dc = decode_concurrency_of(cfg)  # replay.json's figure (computed from the window for older reports)
    for row in dc["bins"]:
        lo, hi = row["functions"]
        print(
            f"   {lo:3d}-{hi:3d} functions: n={row['requests']:5d}  TPOT p50 {row['tpot_ms_p50']:6.1f} ms"
            f"  ({row['ms_per_function']:.1f} ms per function)"
        )


if __name__ == "__main__":
    main()
