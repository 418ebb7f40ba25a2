"""Backbone sharing: memory and attach time for 1..N workers on one backbone vs a private copy each.

    # H100 (the numbers for docs/benchmarks.md):
    python bench/sharing.py --device cuda:0 --model /data/llama-2-7b --json out/sharing.json
    # no model yet: writes the llama-2-7b preset (bfloat16, random weights) into --workdir first
    python bench/sharing.py --device cuda:0 --preset llama-2-7b --workdir /tmp/bb --json out/sharing.json
    # CPU (shared memory), a small model:
    python bench/sharing.py --device cpu --preset tiny --workers 1,2,4 --json out/sharing_cpu.json

For each worker count it reports the total memory in use (GPU: NVML, else torch.cuda.mem_get_info;
CPU: the summed PSS of the workers) and the attach/map time of the workers that joined, against the
no-sharing baseline (one full private copy per worker, run only while N copies fit in the device,
`--baseline-cap-gb`, and extrapolated beyond). It also reports the server's load throughput against
the measured pinned host->device bandwidth and page-cache read bandwidth. Targets (DESIGN §6,
issue 4): map a 7B backbone into a worker <= 50 ms; per-worker GPU memory = context + adapter + KV
only (no weight bytes); load >= 70% of host->device bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.backbone_server.helpers import Probe, ServerProc  # noqa: E402

MiB = 1 << 20


class GpuMemory:
    """Device-wide memory in use, in bytes (NVML when available: it sees every process)."""

    def __init__(self, index: int):
        self.index = index
        self.nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.source = "NVML"
        except Exception:
            self.source = "torch.cuda.mem_get_info (includes this process's context)"

    def used(self) -> int:
        if self.nvml is not None:
            return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
        import torch

        free, total = torch.cuda.mem_get_info(self.index)
        return int(total - free)

    def total(self) -> int:
        if self.nvml is not None:
            return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).total)
        import torch

        return int(torch.cuda.mem_get_info(self.index)[1])


def settle(mem: GpuMemory, seconds: float = 1.0) -> int:
    time.sleep(seconds)
    return mem.used()


def pss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


def ensure_model(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    out = Path(args.workdir or tempfile.mkdtemp(prefix="lorafn-bench-")) / args.preset
    if (out / "config.json").exists():
        return out
    t0 = time.perf_counter()
    print(f"[sharing] writing the {args.preset} preset ({args.dtype}) to {out} ...", flush=True)
    try:
        from lorafn.models.random_model import write_random_model

        write_random_model(args.preset, out, seed=0, dtype=args.dtype, progress=False)
    except Exception as exc:  # the assets package missing or failing: say so, do not guess shapes
        raise SystemExit(f"cannot write the {args.preset} preset: {exc}; pass --model DIR") from exc
    print(f"[sharing] wrote it in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def warm_page_cache(model: Path) -> float:
    """Read every safetensors file once, so the load is measured from the page cache."""
    t0 = time.perf_counter()
    n = 0
    for f in sorted(model.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while b := fh.read(64 * MiB):
                n += len(b)
    return n / max(time.perf_counter() - t0, 1e-9) / 1e9


def server_stats(sock: Path) -> dict[str, Any]:
    from lorafn.backbone_server import protocol as proto

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(sock))
        return proto.request(s, "stats")[0]["stats"]


def spawn(sock: Path | None, device: str, count: int, private: Path | None = None) -> list[Probe]:
    """Start `count` workers. Shared: as standby workers (torch imported, CUDA context up), then
    attach them one after another, so each attach is timed as a standby worker's cold start would
    be, without 30 processes importing torch on the same cores at that moment."""
    if private:
        probes = [
            Probe(Path("/nonexistent"), device, f"bench{i}", "--private", str(private)) for i in range(count)
        ]
        for p in probes:
            p.wait_attached(600)
        return probes
    probes = [Probe(sock or Path("/nonexistent"), device, f"bench{i}", "--standby") for i in range(count)]
    for p in probes:
        msg = p.read(600)
        if msg.get("event") != "standby":
            raise RuntimeError(f"worker did not reach standby: {msg} {p.stderr()}")
    for p in probes:
        assert p.proc.stdin is not None
        p.proc.stdin.write("attach\n")
        p.proc.stdin.flush()
        p.wait_attached(600)
    return probes


def close_all(probes: list[Probe]) -> None:
    for p in probes:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in probes:
        p.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = ensure_model(args)
    counts = sorted({int(x) for x in args.workers.split(",")})
    weights_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    cuda = args.device.startswith("cuda")
    index = int(args.device.split(":")[1]) if cuda and ":" in args.device else 0
    mem = GpuMemory(index) if cuda else None
    res: dict[str, Any] = {
        "model": str(model),
        "weights_bytes": weights_bytes,
        "device": args.device,
        "workers": counts,
        "memory_source": mem.source if mem else "sum of workers' PSS (/proc/PID/smaps_rollup)",
        "page_cache_warm_read_gbps": round(warm_page_cache(model), 2),
    }
    if cuda:
        import torch

        res["gpu"] = torch.cuda.get_device_name(index)
        res["torch"] = torch.__version__
    work = Path(tempfile.mkdtemp(prefix="lorafn-sharing-"))
    sock = work / "bb.sock"

    # ---- shared: one server, workers added 1 -> max ----
    idle = settle(mem, 0.2) if mem else 0
    t0 = time.perf_counter()
    srv = ServerProc(
        model,
        sock,
        args.device,
        "--segment-mib",
        str(args.segment_mib),
        "--streams",
        str(args.streams),
        "--chunk-mib",
        str(args.chunk_mib),
        "--loader",
        args.loader,
    )
    shared_rows = []
    probes: list[Probe] = []
    try:
        srv.wait_ready(600)
        res["server_ready_s"] = round(time.perf_counter() - t0, 2)
        stats = server_stats(sock)
        res["load"] = stats["load"]
        res["mapped_bytes"] = stats["mapped_bytes"]
        after_server = settle(mem) if mem else 0
        res["server_gpu_bytes"] = after_server - idle if mem else None
        for n in counts:
            new = spawn(sock, args.device, n - len(probes))
            probes += new
            used = settle(mem) if mem else 0
            maps = [p.attached["map_s"] for p in new]
            attaches = [p.attached["attach_s"] for p in new]
            row = {
                "workers": n,
                "map_ms_max": round(1e3 * max(maps), 2),
                "map_ms_median": round(1e3 * statistics.median(maps), 2),
                "attach_ms_median": round(1e3 * statistics.median(attaches), 2),
            }
            if mem:
                row["total_gpu_mib"] = round((used - idle) / MiB, 1)
                row["per_worker_mib"] = round((used - after_server) / n / MiB, 1)
            else:
                pss = pss_kib([p.proc.pid for p in probes]) * 1024
                row["total_pss_mib"] = round(pss / MiB, 1)
                row["per_worker_mib"] = round(pss / n / MiB, 1)
            shared_rows.append(row)
            print(f"[sharing] shared {n:>3} workers: {row}", flush=True)
        if probes:
            info = probes[0].ask("info")
            res["worker0_info"] = info
    finally:
        close_all(probes)
        srv.stop()
    res["shared"] = shared_rows

    # ---- baseline: one private copy per worker, while it fits ----
    cap = args.baseline_cap_gb * 1e9 if args.baseline_cap_gb else (mem.total() if mem else 0)
    base_rows = []
    per_copy: float | None = None
    for n in counts:
        need = n * weights_bytes
        if cap and need > 0.92 * cap:
            est = None if per_copy is None else round(n * per_copy / MiB, 1)
            base_rows.append(
                {"workers": n, "ran": False, "total_mib_estimate": est, "why": f"{need / 1e9:.1f} GB > cap"}
            )
            continue
        idle = settle(mem, 0.5) if mem else 0
        ps: list[Probe] = []
        try:
            ps = spawn(None, args.device, n, private=model)
            used = settle(mem) if mem else pss_kib([p.proc.pid for p in ps]) * 1024
            total = used - idle if mem else used
            per_copy = total / n
            loads = [p.attached["attach_s"] for p in ps]
            base_rows.append(
                {
                    "workers": n,
                    "ran": True,
                    "total_mib": round(total / MiB, 1),
                    "per_worker_mib": round(per_copy / MiB, 1),
                    "load_ms_median": round(1e3 * statistics.median(loads), 1),
                }
            )
            print(f"[sharing] private {n:>3} workers: {base_rows[-1]}", flush=True)
        finally:
            close_all(ps)
    res["baseline"] = base_rows
    res["baseline_cap_bytes"] = cap

    # ---- targets ----
    maps_max = max(r["map_ms_max"] for r in shared_rows)
    load = res["load"]
    targets = {"map_ms_max": maps_max, "map_target_ms": 50, "map_ok": maps_max <= 50}
    if load.get("fraction_of_h2d") is not None:
        targets.update(load_fraction_of_h2d=load["fraction_of_h2d"], load_ok=load["fraction_of_h2d"] >= 0.7)
    res["targets"] = targets
    return res


def print_table(res: dict[str, Any]) -> None:
    print()
    print(f"model {res['model']}  weights {res['weights_bytes'] / 1e9:.2f} GB  device {res['device']}")
    load = res["load"]
    print(
        f"load: {load.get('seconds')} s = {load.get('gbps')} GB/s; pinned H2D {load.get('h2d_gbps')} GB/s "
        f"(fraction {load.get('fraction_of_h2d')}); page-cache read {load.get('read_gbps')} GB/s; "
        f"warm read (1 thread) {res['page_cache_warm_read_gbps']} GB/s"
    )
    unit = "GPU MiB" if res["device"].startswith("cuda") else "PSS MiB"
    hdr = (
        f"{'workers':>7} | {'shared total ' + unit:>22} | {'per worker':>10} | {'map ms max':>10} | "
        f"{'attach ms':>9} || {'private total ' + unit:>23} | {'per worker':>10} | {'load ms':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    base = {r["workers"]: r for r in res["baseline"]}
    for r in res["shared"]:
        b = base.get(r["workers"], {})
        total = r.get("total_gpu_mib", r.get("total_pss_mib"))
        if b.get("ran"):
            bt, bp, bl = b["total_mib"], b["per_worker_mib"], b["load_ms_median"]
        else:
            est = b.get("total_mib_estimate")
            bt, bp, bl = (f"~{est} (no fit)" if est else "no fit"), "-", "-"
        print(
            f"{r['workers']:>7} | {total:>22} | {r['per_worker_mib']:>10} | {r['map_ms_max']:>10} | "
            f"{r['attach_ms_median']:>9} || {bt!s:>23} | {bp!s:>10} | {bl!s:>8}"
        )
    print(f"targets: {res['targets']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", help="model directory (config + safetensors)")
    ap.add_argument("--preset", default="llama-2-7b", help="written into --workdir when --model is not given")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workdir")
    ap.add_argument("--workers", default="1,2,4,8,16,32")
    ap.add_argument("--segment-mib", type=int, default=4096)
    ap.add_argument("--streams", type=int, default=8, help="server loader threads/streams")
    ap.add_argument("--loader", default="auto", help="server GPU loader: auto | hostreg | staging")
    ap.add_argument("--chunk-mib", type=int, default=64, help="server pinned staging buffer size")
    ap.add_argument(
        "--baseline-cap-gb",
        type=float,
        default=0,
        help="memory the private copies may use (default: the device's)",
    )
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    res = run(args)
    print_table(res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"[sharing] wrote {args.json}")


if __name__ == "__main__":
    main()
