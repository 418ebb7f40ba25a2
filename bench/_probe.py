"""A probe worker: attach to a backbone server, then answer commands on stdin with JSON lines.

    python bench/_probe.py --socket S --device cuda:0

Used by the backbone-server tests and bench/sharing.py (through tests/integration/backbone_server/
helpers.py), and by an operator who wants to see what a worker sees. A bench helper, not part of the
package: it drives an Engine, and inside lorafn.backbone_server that import pointed up the layers.
Commands (one per line): `digest` (blake2b over every tensor's bytes, name order), `info`
(attach/map time, W's address, memory), `write NAME` (write into a shared tensor: must fault),
`sleep S`, `exit`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any


def digest(tensors: dict[str, Any]) -> str:
    import torch

    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        if t.numel():
            h.update(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _rss_kib() -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{os.getpid()}/smaps_rollup") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("Rss", "Pss", "Shared_Clean", "Private_Clean", "Private_Dirty", "Pss_Shmem"):
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default="probe")
    ap.add_argument("--no-heartbeat", action="store_true")
    ap.add_argument(
        "--private",
        metavar="MODEL_DIR",
        help="no sharing: load MODEL_DIR's safetensors into this process's own memory (the baseline)",
    )
    ap.add_argument(
        "--standby",
        action="store_true",
        help="standby: import torch, create the CUDA context, print standby, attach on an attach line",
    )
    ap.add_argument("--engine", metavar="MODEL_DIR", help="also build an Engine over the shared weights")
    ap.add_argument("--engine-dtype", default="float32")
    args = ap.parse_args(argv)
    if args.private:
        return _private(args)

    t_start = time.perf_counter()
    import torch

    from lorafn.backbone_server.client import SharedWeightSource

    t_import = time.perf_counter() - t_start

    def emit(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    if args.standby:
        if args.device.startswith("cuda"):
            torch.zeros(1, device=args.device)
        emit({"event": "standby", "pid": os.getpid()})
        if sys.stdin.readline().strip() != "attach":
            return 0
    try:
        src = SharedWeightSource(
            args.socket, device=args.device, name=args.name, heartbeat=not args.no_heartbeat
        )
    except Exception as exc:
        emit({"event": "error", "type": type(exc).__name__, "message": str(exc)})
        return 3
    tensors = src.tensors()
    engine = None
    if args.engine:
        from lorafn.runtime import Engine, EngineConfig

        engine = Engine(
            EngineConfig(
                model=args.engine,
                device=str(src.device),
                dtype=args.engine_dtype,
                weight_source=src,
                use_cuda_graphs=False,
                max_num_seqs=8,
                num_kv_blocks=64,
            )
        )
    emit(
        {
            "event": "attached",
            "pid": os.getpid(),
            "attach_s": src.attach_seconds,
            "map_s": src.map_seconds,
            "import_s": t_import,
            "lease_id": src.lease_id,
            "num_tensors": len(tensors),
        }
    )
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "digest":
            emit({"event": "digest", "digest": digest(tensors)})
        elif cmd == "info":
            info: dict[str, Any] = {
                "event": "info",
                "pid": os.getpid(),
                "mem_kib": _rss_kib(),
                "attach_s": src.attach_seconds,
                "map_s": src.map_seconds,
            }
            first = next(iter(tensors.values()))
            info["first_ptr"] = first.data_ptr()
            if src.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(src.device)
                info.update(
                    gpu_free=free,
                    gpu_total=total,
                    torch_allocated=torch.cuda.memory_allocated(src.device),
                    torch_reserved=torch.cuda.memory_reserved(src.device),
                    w_addr=src._mapping.ptr,
                )
            emit(info)
        elif cmd == "write":
            name = arg or max(tensors, key=lambda n: tensors[n].numel())
            emit({"event": "writing", "name": name})
            t = tensors[name]
            t.view(-1)[0:1].add_(1)  # must fault: SIGSEGV (CPU) or an illegal-address error (GPU)
            if t.is_cuda:
                torch.cuda.synchronize(t.device)
            emit({"event": "wrote", "name": name})  # must never be reached
        elif cmd == "generate" and engine is not None:
            from lorafn.runtime import SamplingParams

            outs = engine.generate(json.loads(arg), SamplingParams(max_tokens=12, temperature=0.0))
            emit({"event": "tokens", "tokens": [list(o.token_ids) for o in outs]})
        elif cmd == "sleep":
            time.sleep(float(arg or 1))
            emit({"event": "slept"})
        elif cmd == "exit":
            break
        else:
            emit({"event": "error", "message": f"unknown command {cmd!r}"})
    src.close()
    emit({"event": "closed"})
    return 0


def _private(args: argparse.Namespace) -> int:
    """The no-sharing baseline: a full private copy of the weights in this process."""
    import torch
    from safetensors.torch import load_file

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
    t0 = time.perf_counter()
    tensors: dict[str, Any] = {}
    for f in sorted(os.listdir(args.private)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(args.private, f), device=str(device)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    load_s = time.perf_counter() - t0
    print(
        json.dumps({"event": "attached", "pid": os.getpid(), "attach_s": load_s, "map_s": load_s}), flush=True
    )
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "digest":
            print(json.dumps({"event": "digest", "digest": digest(tensors)}), flush=True)
        elif cmd == "info":
            info: dict[str, Any] = {"event": "info", "pid": os.getpid(), "mem_kib": _rss_kib()}
            if device.type == "cuda":
                info["torch_allocated"] = torch.cuda.memory_allocated(device)
            print(json.dumps(info), flush=True)
        elif cmd == "exit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
