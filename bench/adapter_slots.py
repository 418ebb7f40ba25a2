"""Adapter slots (issue 13): K functions decoding at once, as K one-adapter workers or as one engine whose
batch serves all K (EngineConfig.adapter_slots), side by side in one run.

Each function's worker process reads the whole backbone in every decode step, so K functions decoding at
once cost K steps (the H100 replays measured 7.0-7.2 ms per decoding function, docs/benchmarks.md); one
engine with K adapter slots reads it once for all K rows. Printed per K:
- `K workers`: K x the one-adapter engine's TPOT at batch 1, i.e. K processes time-sliced ideally (the
  replays found the GPU slicing close to that; it is the baseline's lower bound, not a measurement of K
  processes);
- `one adapter, batch K`: the one-adapter engine at batch K (what the slots cannot beat: the same rows
  and the same bytes but one adapter);
- `K slots`: the slot engine at batch K, one row per slot (every slot a different random adapter);
- the ratios: K workers / K slots (the gain), K slots / one adapter batch K (what the slots cost).

On a GPU:
    lorafn model random --preset llama-2-7b --dtype bfloat16 --out /tmp/llama-2-7b --seed 0
    python bench/adapter_slots.py --model /tmp/llama-2-7b
On a CPU a tiny version (random `tiny` preset) prints the same table; read the ratios only:
    python bench/adapter_slots.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import ResidentSource, device_and_dtype, model_or_tiny, random_prompts, sync
from lorafn.runtime import Engine, EngineConfig, SamplingParams
from lorafn.runtime.config import ModelConfig
from lorafn.runtime.lora import write_random_adapter


def decode_tpot(engine: Engine, prompts: list[list[int]], slots: list[int], decode_tokens: int) -> float:
    """Seconds per decode step of `prompts` (one row each, in `slots`), after their prefills."""
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, adapter_slot=s) for p, s in zip(prompts, slots, strict=True)]
    while any(not engine.get_output(i).token_ids for i in ids):  # every prefill done
        engine.step()
    sync(engine.device)
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync(engine.device)
    return (time.perf_counter() - t0) / steps


def best_tpot(engine: Engine, batch: int, slots: list[int], args, vocab: int, repeats: int) -> float:
    """The lowest of `repeats` decode runs (a warm-up first: graphs captured, caches filled)."""
    decode_tpot(engine, random_prompts(batch, args.prompt_len, vocab, 1), slots, 4)
    return min(
        decode_tpot(engine, random_prompts(batch, args.prompt_len, vocab, 10 + r), slots, args.decode_tokens)
        for r in range(repeats)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default with --tiny: a random tiny preset)")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized run: tiny preset, short prompts")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--slots", default=None, help="comma-separated K (default 1,2,4,8,16; tiny 1,2,4)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="all-linear", help="target_modules: all-linear or q_proj,v_proj,...")
    ap.add_argument("--repeats", type=int, default=3, help="decode runs per figure (the lowest is kept)")
    ap.add_argument("--no-graphs", action="store_true", help="CUDA: eager steps (no decode CUDA graphs)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)

    device, tiny, dtype = device_and_dtype(args)
    args.prompt_len = args.prompt_len or (16 if tiny else 128)
    args.decode_tokens = args.decode_tokens or (8 if tiny else 64)
    ks = [int(k) for k in (args.slots or ("1,2,4" if tiny else "1,2,4,8,16")).split(",")]
    if any(k < 1 for k in ks):
        ap.error("--slots: positive integers")
    work = Path(tempfile.mkdtemp(prefix="lorafn-slots-"))
    model_dir = model_or_tiny(ap, args.model, tiny, work)
    mc = ModelConfig.from_dir(model_dir)
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    adapters = [
        write_random_adapter(
            mc,
            work / f"a{i}",
            rank=args.rank,
            lora_alpha=2 * args.rank,
            target_modules=targets,
            dtype=dtype,
            seed=i,
        )
        for i in range(max(ks))
    ]
    source = ResidentSource(model_dir, device, dtype)
    max_len = args.prompt_len + args.decode_tokens + 16
    blocks = max(ks) * -(-max_len // 16) + 16

    def engine(**kw) -> Engine:
        return Engine(
            EngineConfig(
                model=model_dir,
                device=str(device),
                dtype=str(dtype).removeprefix("torch."),
                weight_source=source,
                max_num_seqs=max(ks),
                max_model_len=max_len,
                num_kv_blocks=blocks,
                use_cuda_graphs=not args.no_graphs,
                cuda_graph_batch_sizes=tuple(sorted(set(ks))),
                **kw,
            )
        )

    vocab = mc.vocab_size
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    graphs = "off" if args.no_graphs else "on"
    print(
        f"\nadapter slots: {model_dir.name}, {name}, {dtype}, r{args.rank} {args.targets}, prompt "
        f"{args.prompt_len}, {args.decode_tokens} decode steps, graphs {graphs}"
    )
    print("TPOT ms per step of K rows, one per function; K workers = K x the one-adapter TPOT at batch 1")
    head = f"{'K':>3} | {'K workers':>10} {'one adapter, batch K':>21} {'K slots':>9} | {'gain':>6} "
    head += f"{'slot cost':>9} {'slot start s':>12}"
    print(head)
    print("-" * len(head), flush=True)
    one = engine(adapter=adapters[0])
    t1 = best_tpot(one, 1, [0], args, vocab, args.repeats)
    rows = []
    for k in ks:  # each row printed as it is measured: a run cut short keeps the rows it finished
        single = best_tpot(one, k, [0] * k, args, vocab, args.repeats)
        t0 = time.perf_counter()
        eng = engine(adapters=tuple(adapters[:k]), adapter_slots=k)
        slotted = best_tpot(eng, k, list(range(k)), args, vocab, args.repeats)
        # start-up and measuring together: on a GPU mostly the Triton compiles of this K's kernels
        took = time.perf_counter() - t0
        del eng
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        workers = k * t1
        rows.append(
            {"k": k, "workers_s": workers, "one_adapter_s": single, "slots_s": slotted, "slot_run_s": took}
        )
        print(
            f"{k:>3} | {workers * 1e3:>10.2f} {single * 1e3:>21.2f} {slotted * 1e3:>9.2f} | "
            f"{workers / slotted:>5.2f}x {slotted / single:>8.3f}x {took:>12.0f}",
            flush=True,
        )
    print("gain = K workers / K slots; slot cost = K slots / one adapter at batch K")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "dtype": str(dtype), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
