"""Where a standby's bind goes: cProfile of `Engine.bind_adapter` into prepared buffers (and a second bind
of the same adapter into a second standby engine, with the process warm), on the given model.

    python bench/bind_profile.py --model /tmp/llama-2-7b --device cuda
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    from lorafn.api.adapters import validate_adapter
    from lorafn.runtime import Engine, EngineConfig
    from lorafn.runtime.config import ModelConfig
    from lorafn.runtime.lora import write_random_adapter

    work = Path(tempfile.mkdtemp())
    adapter = write_random_adapter(ModelConfig.from_dir(args.model), work / "a", rank=args.rank)
    shape = validate_adapter(adapter, args.model).shape_key
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=args.model, lora_shape=shape, device=args.device, num_kv_blocks=512))
    print(f"standby engine built in {time.perf_counter() - t0:.1f} s", flush=True)
    for attempt in ("first bind (cold page cache for the adapter file)", "second bind (same file, warm)"):
        if attempt.startswith("second"):
            engine = Engine(
                EngineConfig(model=args.model, lora_shape=shape, device=args.device, num_kv_blocks=512)
            )
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        how = engine.bind_adapter(adapter)
        prof.disable()
        print(f"{attempt}: {1000 * (time.perf_counter() - t0):.1f} ms ({how})", flush=True)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(18)


if __name__ == "__main__":
    main()
