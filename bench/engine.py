"""Engine benchmark (DESIGN §9, issue 3): TTFT, TPOT and tokens/s for base vs unmerged LoRA, against
transformers + peft on the same weights and against the HBM floor (weight bytes ÷ measured copy bandwidth).

On a GPU (the issue's setup):
    lorafn model random --preset llama-2-7b --dtype bfloat16 --out /tmp/llama-2-7b --seed 0
    python bench/engine.py --model /tmp/llama-2-7b
On a CPU it runs a tiny version (random `tiny` preset, short prompts) that prints ratios only:
    python bench/engine.py --tiny

The LoRA engine runs with each `EngineConfig.lora_expand` (how a step above 16 rows adds the expands:
`grouped`, the default, inside the kernels that read the projections' outputs; `per_projection`, one addmm_
each; `in_kernels`, inside the per-row elementwise kernels; `hybrid`, per_projection for steps with a prefill
chunk and in_kernels for decode-only steps; or any "PREFILL/DECODE" pair): they differ only in TTFT and in
decode batches above 16, so the modes other than the default measure those only (`--expand-modes` picks them).

`--skinny-rows 16` measures the batches above 16 again with `EngineConfig.skinny_gemm_rows` = 16 (their GEMMs
through cuBLAS + a shrink GEMM per group, the path before the default became 64); `--repeats N` runs every
engine once per round, N rounds, and prints medians (single runs on the H100 moved ±5%).

`--attention-kernels dot` measures base and LoRA again at every batch with that
`EngineConfig.decode_attention` (the paged decode attention kernel's form) beside the default's.
`--other-expand-place` measures LoRA again at every batch with `EngineConfig.expand_in_gemm` the other way
round from its default: a skinny-GEMM step's expands inside the GEMMs, or in the per-row kernels after them.
`--gemm-prologue-rows 64` measures base and LoRA again at every batch with `EngineConfig.gemm_prologue_rows` =
64: steps of up to that many rows compute the residual add + RMSNorm and SiLU·up inside the skinny GEMMs.
`--rope-in-attention` measures base and LoRA again at every batch with `EngineConfig.rope_in_attention` the
other way round: a decode-only step's RoPE and K/V cache writes inside its attention launch, or before it.
`--lora-shrinks triton` measures LoRA again (the default mode and each of `--expand-modes`, eager and with
`--prefill-graphs`) with that `EngineConfig.lora_shrink`: how steps above skinny_gemm_rows rows (prefill
chunks) compute the shrinks; TTFT and chunked-prefill throughput side by side with the default's.

The backbone is loaded onto the device once and shared by every engine of the run (a resident
WeightSource, as the backbone server shares it with workers); transformers loads its own copy.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lorafn.api.settings import token_buckets
from lorafn.runtime import Engine, EngineConfig, SamplingParams
from lorafn.runtime.config import (
    DECODE_ATTENTION_KERNELS,
    DEFAULT_DECODE_ATTENTION,
    DEFAULT_EXPAND_IN_GEMM,
    DEFAULT_GEMM_PROLOGUE_ROWS,
    DEFAULT_LORA_EXPAND,
    DEFAULT_LORA_SHRINK,
    DEFAULT_ROPE_IN_ATTENTION,
    DEFAULT_SKINNY_GEMM_ROWS,
    LORA_EXPANDS,
    LORA_SHRINKS,
    SKINNY_GEMM_MAX_ROWS,
    ModelConfig,
    expand_modes,
)
from lorafn.runtime.local_weights import SafetensorsWeightSource
from lorafn.runtime.lora import write_random_adapter


class ResidentSource:
    """Every backbone tensor copied to the device once; engines get views of these copies."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        files = SafetensorsWeightSource(model_dir)
        self.tensors = {n: files.get(n, device, dtype) for n in files.names()}
        files.close()

    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, name, device, dtype):
        return self.tensors[name].to(device=device, dtype=dtype)

    def read_only(self) -> bool:
        return True

    def close(self) -> None:
        self.tensors.clear()

    def __iter__(self):
        return iter(self.tensors)


LARGE_STEP_ROWS = 16  # fused_decode.MAX_TOKENS: steps of more rows add their expands as lora_expand says


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy, counting read + write traffic (what a decode step streams)."""
    nbytes = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / min(times)


def device_and_dtype(args: argparse.Namespace) -> tuple[torch.device, bool, torch.dtype]:
    """(device, tiny, dtype) of a bench's `--device`, `--tiny`, `--dtype`: CPU runs are tiny; dtype by default
    bfloat16 on CUDA, float32 on CPU."""
    device = torch.device(args.device)
    tiny = args.tiny or device.type == "cpu"
    default = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, tiny, getattr(torch, args.dtype) if args.dtype else default


def model_or_tiny(ap: argparse.ArgumentParser, model_dir: Path | None, tiny: bool, work: Path) -> Path:
    """`--model`, else (a tiny run) a random `tiny` preset written under `work`."""
    if model_dir is not None:
        return model_dir
    if not tiny:
        ap.error("--model is required on a GPU (write it with `lorafn model random --preset llama-2-7b`)")
    from lorafn.models.random_model import write_random_model

    return write_random_model("tiny", work / "tiny", seed=0, progress=False)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (batch, length), generator=gen).tolist()


def measure_engine(
    engine: Engine, prompt_len: int, batches: list[int], decode_tokens: int, vocab: int
) -> dict:
    device = engine.device
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate(random_prompts(1, prompt_len, vocab, 0), greedy)  # warm-up
    ttfts = []
    for i in range(5):
        sync(device)
        t0 = time.perf_counter()
        engine.generate(random_prompts(1, prompt_len, vocab, 100 + i), greedy)
        sync(device)
        ttfts.append(time.perf_counter() - t0)
    result = {
        "ttft_s": statistics.median(ttfts),
        "tpot_s": {},
        "tokens_per_s": {},
        "prefill_tokens_per_s": {},
    }
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
    for batch in batches:
        ids = [engine.add_request(p, params) for p in random_prompts(batch, prompt_len, vocab, batch)]
        outs = [engine.get_output(i) for i in ids]
        while any(not o.token_ids for o in outs):  # all prefills done
            engine.step()
        sync(device)  # with overlapped steps a decode step is queued: it ran before t0, so it is not counted
        t0 = time.perf_counter()
        # Timed until the first request ends: the prompts were prefilled over several steps, so the first ones
        # have more tokens and end first, and the steps after that no longer decode the whole batch. The steps
        # read back by then: the first to end had the most tokens at t0.
        steps = params.max_tokens - max(len(o.token_ids) for o in outs) - engine.num_queued_steps
        if steps < 1:
            raise SystemExit(
                f"batch {batch}: its first prompts had all {params.max_tokens} tokens before the last was "
                "prefilled; raise --decode-tokens"
            )
        while not any(o.finished for o in outs):
            engine.step()
        sync(device)
        tpot = (time.perf_counter() - t0) / steps
        while engine.has_unfinished():
            engine.step()
        result["tpot_s"][batch] = tpot
        result["tokens_per_s"][batch] = batch / tpot
        result["prefill_tokens_per_s"][batch] = chunked_prefill_rate(engine, batch, prompt_len, vocab)
    return result


def chunked_prefill_rate(engine: Engine, batch: int, prompt_len: int, vocab: int) -> float:
    """Prompt tokens a second for `batch` prompts that each generate one token, in chunks of the step's budget
    (max_num_batched_tokens): timed after the batch's TPOT run, so that its chunk shapes ran before (the
    first pass, timed so, read 8358 tokens/s at batch 16 against 29339 at 64 on the H200: kernels compiled
    and graphs captured for the shapes it met first)."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(batch, prompt_len, vocab, 1000 + batch)
    sync(engine.device)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, one)
    while engine.has_unfinished():
        engine.step()
    sync(engine.device)
    return batch * prompt_len / (time.perf_counter() - t0)


def median_result(results: list[dict]) -> dict:
    """The median of each figure over rounds of `measure_engine` (and every round's figures)."""
    first = results[0]
    out: dict = {"ttft_s": statistics.median(r["ttft_s"] for r in results), "tpot_s": {}, "tokens_per_s": {}}
    for b in first["tpot_s"]:
        out["tpot_s"][b] = statistics.median(r["tpot_s"][b] for r in results)
        out["tokens_per_s"][b] = b / out["tpot_s"][b]
    out["prefill_tokens_per_s"] = {
        b: statistics.median(r["prefill_tokens_per_s"][b] for r in results)
        for b in first["prefill_tokens_per_s"]
    }
    out["rounds"] = results
    return out


def profile_prefill(engine: Engine, prompt_len: int, vocab: int) -> dict[str, tuple[int, float]]:
    """{kernel family: (kernels, µs)} of one prefill of `prompt_len` tokens (mean of 3; CUPTI)."""
    from decode_profile import kernel_table  # (it imports this module: imported here, when needed)

    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = random_prompts(1, prompt_len, vocab, 7)
    return kernel_table(lambda: engine.generate(prompt, greedy), steps=3)


def host_profile_prefill(engine: Engine, prompt_len: int, vocab: int, top: int = 16) -> list[dict]:
    """The host's side of 5 prefills of `prompt_len` tokens (one warm-up first) under cProfile: the `top`
    functions by own time, each with its calls and ms a prefill. The eager LoRA prefill is host-bound on
    the device's CPU (issue 12: TTFT); this says in which Python functions its time goes."""
    import cProfile
    import pstats

    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate(random_prompts(1, prompt_len, vocab, 11), greedy)
    prompts = [random_prompts(1, prompt_len, vocab, 20 + i) for i in range(5)]
    sync(engine.device)
    profiler = cProfile.Profile()
    profiler.enable()
    for prompt in prompts:
        engine.generate(prompt, greedy)
    sync(engine.device)
    profiler.disable()
    # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {"function": f"{Path(file).name}:{line}({name})", "calls": calls / 5, "own_ms": own * 1e3 / 5}
        for (file, line, name), (_prim, calls, own, _cum, _callers) in rows
    ]


def print_host_profiles(f: dict, names: list[str]) -> None:
    for name in names:
        rows = f.get(name, {}).get("prefill_host_profile")
        if not rows:
            continue
        print(f"\nhost time of one prefill of {f['prompt_len']} tokens, {name} (cProfile, own ms, calls):")
        for r in rows:
            print(f"  {r['own_ms']:8.3f} ms {r['calls']:8.0f}  {r['function']}")


def print_prefill_kernels(f: dict, names: list[str], top: int = 14) -> None:
    """Side by side: kernels and µs per prefill by family, the largest `top` families, then the totals."""
    runs = [(n, f[n]["prefill_kernels"]) for n in names if "prefill_kernels" in f.get(n, {})]
    if not runs:
        return
    families = sorted(
        {k for _n, t in runs for k in t}, key=lambda k: -max(t.get(k, (0, 0.0))[1] for _n, t in runs)
    )
    print(f"\nwhere one prefill of {f['prompt_len']} tokens goes (kernels / µs, CUDA time):")
    print(f"{'kernel family':<62}" + "".join(f" {n[:18]:>18}" for n, _t in runs))
    for k in families[:top]:
        print(
            f"{k[:62]:<62}"
            + "".join(f" {t.get(k, (0, 0.0))[0]:>6} {t.get(k, (0, 0.0))[1]:>11.0f}" for _n, t in runs)
        )
    print(
        f"{'total':<62}"
        + "".join(
            f" {sum(c for c, _u in t.values()):>6} {sum(u for _c, u in t.values()):>11.0f}" for _n, t in runs
        )
    )


def measure_hf(
    model_dir: Path,
    adapter: Path,
    device: torch.device,
    dtype: torch.dtype,
    prompt_len: int,
    batches: list[int],
    decode_tokens: int,
    vocab: int,
) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model = PeftModel.from_pretrained(model, adapter).eval()

    def run(batch: int, new_tokens: int, seed: int) -> float:
        x = torch.tensor(random_prompts(batch, prompt_len, vocab, seed), device=device)
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        sync(device)
        return time.perf_counter() - t0

    run(1, 2, 0)
    result = {
        "ttft_s": statistics.median(run(1, 1, 100 + i) for i in range(3)),
        "tpot_s": {},
        "tokens_per_s": {},
    }
    for batch in batches:
        t1 = min(run(batch, 1, batch) for _ in range(2))
        tn = min(run(batch, decode_tokens + 1, batch) for _ in range(2))
        tpot = (tn - t1) / decode_tokens
        result["tpot_s"][batch] = tpot
        result["tokens_per_s"][batch] = batch / tpot
    model = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default with --tiny: a random tiny preset)")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized run: tiny preset, short prompts")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes")
    ap.add_argument("--decode-tokens", type=int, default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument(
        "--targets",
        default="all-linear",
        help="the adapter's target_modules: all-linear or comma-separated projections, e.g. q_proj,v_proj",
    )
    ap.add_argument("--skip-hf", action="store_true", help="do not run transformers + peft")
    ap.add_argument(
        "--expand-modes",
        default=",".join([m for m in LORA_EXPANDS if m != DEFAULT_LORA_EXPAND] + ["hybrid"]),
        help=f"lora_expand modes measured beside the default {DEFAULT_LORA_EXPAND!r} (comma-separated, or "
        "''): names of EngineConfig.lora_expand, e.g. grouped, in_kernels, hybrid, per_projection/grouped",
    )
    ap.add_argument(
        "--skinny-rows",
        default="16",
        help=f"EngineConfig.skinny_gemm_rows values measured beside the default {DEFAULT_SKINNY_GEMM_ROWS} "
        "(comma-separated, or ''): base and every LoRA mode again at the batches above 16, where they differ",
    )
    ap.add_argument(
        "--profile-prefill",
        action="store_true",
        help="CUDA: a kernel table of one prefill per engine (torch.profiler, as bench/decode_profile.py)",
    )
    ap.add_argument(
        "--host-profile-prefill",
        action="store_true",
        help="cProfile the host's side of a prefill per engine (base, lora, --expand-modes): where TTFT goes",
    )
    ap.add_argument(
        "--prefill-graphs",
        default="",
        help="CUDA: token buckets of prefill CUDA graphs (EngineConfig.prefill_graph_tokens, comma-separated,"
        " e.g. 128,512): base and LoRA again with them, TTFT side by side with the eager prefill",
    )
    ap.add_argument(
        "--attention-kernels",
        default="",
        help=f"CUDA: EngineConfig.decode_attention kernels measured beside the default "
        f"{DEFAULT_DECODE_ATTENTION!r} (comma-separated, of {', '.join(DECODE_ATTENTION_KERNELS)}): base and "
        "LoRA again at every batch",
    )
    ap.add_argument(
        "--other-expand-place",
        action="store_true",
        help="CUDA: LoRA again at every batch with EngineConfig.expand_in_gemm not its default, beside it",
    )
    ap.add_argument(
        "--gemm-prologue-rows",
        type=int,
        default=None,
        help=f"CUDA: base and LoRA again at every batch with EngineConfig.gemm_prologue_rows = N (default "
        f"{DEFAULT_GEMM_PROLOGUE_ROWS}: each step's norms and SiLU·up inside the skinny GEMMs up to N rows)",
    )
    ap.add_argument(
        "--rope-in-attention",
        action="store_true",
        help="CUDA: base and LoRA again at every batch with EngineConfig.rope_in_attention not its default "
        f"({DEFAULT_ROPE_IN_ATTENTION}: a decode step's RoPE + K/V writes inside its attention launch)",
    )
    ap.add_argument(
        "--other-overlap",
        action="store_true",
        help="base and LoRA again at every batch with EngineConfig.overlap_steps not the device's default "
        "(CUDA: steps one at a time; CPU: overlapped), beside it",
    )
    ap.add_argument(
        "--lora-shrinks",
        default="",
        help=f"CUDA: EngineConfig.lora_shrink values measured beside the default {DEFAULT_LORA_SHRINK!r} "
        f"(comma-separated, of {', '.join(LORA_SHRINKS)}): LoRA again, each lora_expand mode, TTFT (with "
        "--prefill-graphs too) and chunked prefill",
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="rounds of every run (figures: the median over the rounds)"
    )
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)

    device, tiny, dtype = device_and_dtype(args)
    prompt_len = args.prompt_len or (32 if tiny else 512)
    batches = [int(b) for b in (args.batches or ("1,4" if tiny else "1,8,32,64")).split(",")]
    decode_tokens = args.decode_tokens or (8 if tiny else 64)
    work = Path(tempfile.mkdtemp(prefix="lorafn-bench-"))
    model_dir = model_or_tiny(ap, args.model, tiny, work)
    mc = ModelConfig.from_dir(model_dir)
    adapter = write_random_adapter(
        mc,
        work / "adapter",
        rank=args.rank,
        lora_alpha=2 * args.rank,
        target_modules=args.targets if args.targets == "all-linear" else args.targets.split(","),
        dtype=dtype,
    )

    t0 = time.perf_counter()
    source = ResidentSource(model_dir, device, dtype)
    load_s = time.perf_counter() - t0
    max_seqs = max(batches)
    max_len = prompt_len + decode_tokens + 8
    block_size = 16
    blocks = max_seqs * -(-max_len // block_size) + 16
    figures: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "model": str(model_dir),
        "prompt_len": prompt_len,
        "decode_tokens": decode_tokens,
        "rank": args.rank,
        "targets": args.targets,
        "backbone_load_s": load_s,
    }
    modes = [m for m in args.expand_modes.split(",") if m and m != DEFAULT_LORA_EXPAND]
    for mode in modes:
        try:
            expand_modes(mode)
        except ValueError as err:
            ap.error(f"--expand-modes: {err}")
    skinny = [int(r) for r in args.skinny_rows.split(",") if r and int(r) != DEFAULT_SKINNY_GEMM_ROWS]
    if any(not 1 <= r <= SKINNY_GEMM_MAX_ROWS for r in skinny):
        ap.error(f"--skinny-rows: each in [1, {SKINNY_GEMM_MAX_ROWS}], got {args.skinny_rows}")
    figures["lora_expand"] = DEFAULT_LORA_EXPAND
    figures["expand_modes"] = modes
    figures["skinny_gemm_rows"] = DEFAULT_SKINNY_GEMM_ROWS
    figures["skinny_variants"] = skinny
    bandwidth = copy_bandwidth(device)
    large = [b for b in batches if b > LARGE_STEP_ROWS]
    # (figures key, adapter, lora_expand, batches, skinny_gemm_rows): the defaults in full, the others where
    # they differ
    d_rows = DEFAULT_SKINNY_GEMM_ROWS
    runs: list[tuple[str, Path | None, str, list[int], int, dict]] = [
        ("base", None, DEFAULT_LORA_EXPAND, batches, d_rows, {}),
        ("lora", adapter, DEFAULT_LORA_EXPAND, batches, d_rows, {}),
    ]
    runs += [(f"lora_{m}", adapter, m, large, d_rows, {}) for m in modes]
    for rows in skinny if device.type == "cuda" and large else []:
        runs += [(f"base_s{rows}", None, DEFAULT_LORA_EXPAND, large, rows, {})]
        runs += [(f"lora_s{rows}", adapter, DEFAULT_LORA_EXPAND, large, rows, {})]
        runs += [(f"lora_{m}_s{rows}", adapter, m, large, rows, {}) for m in modes]
    try:
        prefill_buckets = token_buckets(args.prefill_graphs)
    except ValueError as err:
        ap.error(f"--prefill-graphs: {err}")
    figures["prefill_graph_tokens"] = list(prefill_buckets)
    if prefill_buckets and device.type == "cuda":  # TTFT only: decode steps are the same graphs as without
        pg = {"prefill_graph_tokens": prefill_buckets}
        runs += [("base_pg", None, DEFAULT_LORA_EXPAND, [], d_rows, pg)]
        runs += [("lora_pg", adapter, DEFAULT_LORA_EXPAND, [], d_rows, pg)]
        runs += [(f"lora_pg_{m}", adapter, m, [], d_rows, pg) for m in modes]
    kernels = [k for k in args.attention_kernels.split(",") if k and k != DEFAULT_DECODE_ATTENTION]
    if any(k not in DECODE_ATTENTION_KERNELS for k in kernels):
        ap.error(f"--attention-kernels: each of {DECODE_ATTENTION_KERNELS}, got {args.attention_kernels!r}")
    figures["decode_attention"] = DEFAULT_DECODE_ATTENTION
    figures["attention_variants"] = kernels if device.type == "cuda" else []
    for kernel in figures["attention_variants"]:
        att = {"decode_attention": kernel}
        runs += [(f"base_att_{kernel}", None, DEFAULT_LORA_EXPAND, batches, d_rows, att)]
        runs += [(f"lora_att_{kernel}", adapter, DEFAULT_LORA_EXPAND, batches, d_rows, att)]
    figures["expand_in_gemm"] = DEFAULT_EXPAND_IN_GEMM
    figures["other_expand_place"] = bool(args.other_expand_place and device.type == "cuda")
    if figures["other_expand_place"]:
        other = {"expand_in_gemm": not DEFAULT_EXPAND_IN_GEMM}
        runs += [("lora_other_place", adapter, DEFAULT_LORA_EXPAND, batches, d_rows, other)]
    figures["gemm_prologue_rows"] = DEFAULT_GEMM_PROLOGUE_ROWS
    pro_rows = args.gemm_prologue_rows
    if pro_rows is not None and not 0 <= pro_rows <= SKINNY_GEMM_MAX_ROWS:
        ap.error(f"--gemm-prologue-rows: must be in [0, {SKINNY_GEMM_MAX_ROWS}], got {pro_rows}")
    figures["prologue_variant_rows"] = pro_rows if device.type == "cuda" else None
    if figures["prologue_variant_rows"] is not None:
        pro = {"gemm_prologue_rows": pro_rows}
        runs += [("base_prologue", None, DEFAULT_LORA_EXPAND, batches, d_rows, pro)]
        runs += [("lora_prologue", adapter, DEFAULT_LORA_EXPAND, batches, d_rows, pro)]
    figures["rope_in_attention"] = DEFAULT_ROPE_IN_ATTENTION
    figures["rope_variant"] = bool(args.rope_in_attention and device.type == "cuda")
    if figures["rope_variant"]:
        rope = {"rope_in_attention": not DEFAULT_ROPE_IN_ATTENTION}
        runs += [("base_rope_attn", None, DEFAULT_LORA_EXPAND, batches, d_rows, rope)]
        runs += [("lora_rope_attn", adapter, DEFAULT_LORA_EXPAND, batches, d_rows, rope)]
    shrinks = [k for k in args.lora_shrinks.split(",") if k and k != DEFAULT_LORA_SHRINK]
    if any(k not in LORA_SHRINKS for k in shrinks):
        ap.error(f"--lora-shrinks: each of {LORA_SHRINKS}, got {args.lora_shrinks!r}")
    figures["lora_shrink"] = DEFAULT_LORA_SHRINK
    figures["shrink_variants"] = shrinks if device.type == "cuda" else []
    for k in figures["shrink_variants"]:
        sh = {"lora_shrink": k}
        runs += [(f"lora_shrink_{k}", adapter, DEFAULT_LORA_EXPAND, batches, d_rows, sh)]
        runs += [(f"lora_{m}_shrink_{k}", adapter, m, large, d_rows, sh) for m in modes]
        if prefill_buckets:
            pgs = {"prefill_graph_tokens": prefill_buckets, **sh}
            runs += [(f"lora_pg_shrink_{k}", adapter, DEFAULT_LORA_EXPAND, [], d_rows, pgs)]
            runs += [(f"lora_pg_{m}_shrink_{k}", adapter, m, [], d_rows, pgs) for m in modes]
    figures["overlap_steps"] = device.type == "cuda"  # EngineConfig.overlap_steps' default on the device
    if args.other_overlap:
        other = {"overlap_steps": not figures["overlap_steps"]}
        runs += [("base_other_overlap", None, DEFAULT_LORA_EXPAND, batches, d_rows, other)]
        runs += [("lora_other_overlap", adapter, DEFAULT_LORA_EXPAND, batches, d_rows, other)]
    # every run once per round, rounds one after another: each figure is the median over the rounds, so a
    # drift of the machine during the run (the H100's figures moved ±5% between runs) reaches every run alike
    figures["repeats"] = args.repeats
    figures["max_num_batched_tokens"] = max(2048, prompt_len)

    def engine_for(adapter_dir: Path | None, mode: str, rows: int, **overrides) -> Engine:
        settings = dict(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=figures["max_num_batched_tokens"],
            num_kv_blocks=blocks,
            block_size=block_size,
        )
        settings.update(overrides)
        return Engine(
            EngineConfig(
                model=model_dir,
                adapter=adapter_dir,
                device=str(device),
                dtype=str(dtype).removeprefix("torch."),
                weight_source=source,
                max_model_len=max_len,
                lora_expand=mode,
                skinny_gemm_rows=rows,
                **settings,
            )
        )

    rounds: dict[str, list[dict]] = {name: [] for name, *_rest in runs}
    for _round in range(args.repeats):
        for name, adapter_dir, mode, run_batches, rows, overrides in runs:
            t0 = time.perf_counter()
            engine = engine_for(adapter_dir, mode, rows, **overrides)
            figures[f"{name}_engine_start_s"] = time.perf_counter() - t0
            figures[f"{name}_graph_capture_s"] = engine.runner.graph_capture_s
            pgr = engine.runner.prefill_graphs
            if pgr is not None:
                figures[f"{name}_prefill_capture_s"] = pgr.capture_s
            if device.type == "cuda":  # what the engine holds besides the backbone (graph pools included)
                figures[f"{name}_reserved_bytes"] = int(torch.cuda.memory_reserved(device))
            figures["weight_bytes"] = engine.runner.model.weight_bytes()
            rounds[name].append(measure_engine(engine, prompt_len, run_batches, decode_tokens, mc.vocab_size))
            if pgr is not None:
                figures[f"{name}_prefill_replays"] = pgr.replays  # > 0: the TTFT above is the graph's
            if device.type == "cuda":  # after prefills and decodes: the eager runs' cached activations too
                figures[f"{name}_reserved_after_bytes"] = int(torch.cuda.memory_reserved(device))
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for name, results in rounds.items():
        figures[name] = median_result(results)
    # after every timing (CUPTI slowed what ran after it; cProfile slows what it watches), each profile in an
    # engine of its own: (figures key, profile, engine settings)
    profiles = []
    if args.profile_prefill and device.type == "cuda":
        one = {"max_num_seqs": 1, "num_kv_blocks": None, "use_cuda_graphs": False}
        profiles.append(("prefill_kernels", profile_prefill, one))
    if args.host_profile_prefill:
        profiles.append(
            ("prefill_host_profile", host_profile_prefill, {"max_num_seqs": 1, "num_kv_blocks": None})
        )
    for key, profile, settings in profiles:  # every kernel table first, then every host profile
        for name, adapter_dir, mode, _batches, rows, overrides in runs:
            if set(overrides) - {"lora_shrink"}:  # prefill graphs, attention, expand place: no new prefill
                continue
            engine = engine_for(adapter_dir, mode, rows, **{**overrides, **settings})
            figures[name][key] = profile(engine, prompt_len, mc.vocab_size)
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    source.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_hf:
        figures["hf_peft"] = measure_hf(
            model_dir, adapter, device, dtype, prompt_len, batches, decode_tokens, mc.vocab_size
        )
    figures["copy_bandwidth_Bps"] = bandwidth
    floor = figures["weight_bytes"] / bandwidth
    figures["hbm_floor_tpot_s"] = floor
    # a decode step also reads every sequence's K and V: the floor of batch b adds b sequences at the timed
    # steps' mean context (prompt + 1 .. prompt + decode_tokens)
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * torch.finfo(dtype).bits // 8
    mean_context = prompt_len + (decode_tokens + 1) / 2
    figures["kv_bytes_per_token"] = kv_per_token
    figures["floor_with_kv_s"] = {
        b: (figures["weight_bytes"] + b * mean_context * kv_per_token) / bandwidth for b in batches
    }

    print_table(figures, batches, tiny)
    print_skinny(figures, large)
    print_prefill_graphs(figures)
    print_shrinks(figures, batches)
    print_attention(figures, batches)
    print_expand_places(figures, batches)
    print_prologue(figures, batches)
    print_rope_in_attention(figures, batches)
    print_overlap(figures, batches)
    print_prefill_kernels(figures, [name for name, *_rest in runs])
    print_host_profiles(figures, [name for name, *_rest in runs])
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    return 0


def print_skinny(f: dict, large: list[int]) -> None:
    """TPOT at the batches above 16 with each skinny_gemm_rows variant beside the default's."""
    if not f["skinny_variants"] or not large:
        return
    ms = 1e3
    modes = [DEFAULT_LORA_EXPAND, *f["expand_modes"]]
    print(f"\nskinny_gemm_rows (default {f['skinny_gemm_rows']}): TPOT ms at batches above 16; LoRA overhead")
    print("over the base of the same rows, and over the default base (the issue's figure) in brackets")
    for b in large:
        for rows in [f["skinny_gemm_rows"], *f["skinny_variants"]]:
            suffix = "" if rows == f["skinny_gemm_rows"] else f"_s{rows}"
            base = f[f"base{suffix}"]["tpot_s"][b]
            line = f"  batch {b:>3} rows {rows:>2}: base {base * ms:6.2f}"
            for m in modes:
                r = f["lora" + suffix if m == DEFAULT_LORA_EXPAND else f"lora_{m}{suffix}"]["tpot_s"][b]
                ref = f["base"]["tpot_s"][b]
                line += f" | {m} {r * ms:6.2f} {100 * (r / base - 1):+5.1f}% ({100 * (r / ref - 1):+5.1f}%)"
            print(line)


def print_attention(f: dict, batches: list[int]) -> None:
    """TPOT with each other decode attention kernel beside the default's, base and LoRA."""
    if not f["attention_variants"]:
        return
    ms, floor, default = 1e3, f["hbm_floor_tpot_s"], f["decode_attention"]
    print(f"\ndecode attention kernels (default {default!r}): TPOT ms (over the HBM floor), LoRA overhead")
    print("over the same kernel's base, and each kernel's base / LoRA TPOT over the default's")
    for b in batches:
        base, lora = f["base"]["tpot_s"][b], f["lora"]["tpot_s"][b]
        line = f"  batch {b:>3}: {default} base {base * ms:6.2f} ({base / floor:.2f}) lora {lora * ms:6.2f}"
        line += f" ({lora / floor:.2f}) {100 * (lora / base - 1):+5.1f}%"
        for kernel in f["attention_variants"]:
            kb, kl = f[f"base_att_{kernel}"]["tpot_s"][b], f[f"lora_att_{kernel}"]["tpot_s"][b]
            line += f" | {kernel} base {kb * ms:6.2f} ({kb / floor:.2f})"
            line += f" lora {kl * ms:6.2f} ({kl / floor:.2f})"
            line += f" {100 * (kl / kb - 1):+5.1f}%, x{kb / base:.3f} / x{kl / lora:.3f}"
        print(line)


def print_expand_places(f: dict, batches: list[int]) -> None:
    """LoRA TPOT with a skinny step's expands in the GEMMs beside in the per-row kernels (expand_in_gemm)."""
    if not f["other_expand_place"]:
        return
    ms = 1e3
    gemm, rows = ("lora", "lora_other_place") if f["expand_in_gemm"] else ("lora_other_place", "lora")
    print("\nLoRA expands in the skinny GEMMs vs in the per-row kernels (expand_in_gemm; default: in the")
    where = "GEMMs" if f["expand_in_gemm"] else "per-row kernels"
    print(f"{where}): TPOT ms and the LoRA overhead over the base")
    for b in batches:
        base, in_gemm, per_row = (f[n]["tpot_s"][b] for n in ("base", gemm, rows))
        line = f"  batch {b:>3}: base {base * ms:6.2f}"
        line += f" | in GEMMs {in_gemm * ms:6.2f} {100 * (in_gemm / base - 1):+5.1f}%"
        line += f" | per-row {per_row * ms:6.2f} {100 * (per_row / base - 1):+5.1f}%"
        print(line + f" | in GEMMs / per-row {in_gemm / per_row:.3f}")
    print(f"  TTFT: in GEMMs {f[gemm]['ttft_s'] * ms:.1f} ms, per-row {f[rows]['ttft_s'] * ms:.1f} ms")


def print_prologue(f: dict, batches: list[int]) -> None:
    """TPOT with the GEMM inputs computed inside the skinny GEMMs (gemm_prologue_rows) beside the default."""
    rows = f["prologue_variant_rows"]
    if rows is not None:
        title = f"norms and SiLU·up inside the skinny GEMMs up to {rows} rows (gemm_prologue_rows; default"
        title += f" {f['gemm_prologue_rows']})"
        print_variant(f, batches, "prologue", title)


def print_rope_in_attention(f: dict, batches: list[int]) -> None:
    """TPOT with a decode step's RoPE + K/V writes inside its attention launch beside the default."""
    if f["rope_variant"]:
        title = "RoPE + K/V writes inside the decode attention launch (rope_in_attention; default"
        title += f" {f['rope_in_attention']})"
        print_variant(f, batches, "rope_attn", title)


def print_variant(f: dict, batches: list[int], variant: str, title: str) -> None:
    """TPOT of base and LoRA run again with an override (runs base_VARIANT, lora_VARIANT) beside the
    default's, over the HBM floor, with the LoRA overhead of each."""
    ms, floor = 1e3, f["hbm_floor_tpot_s"]
    print(f"\n{title}:")
    print("TPOT ms (over the HBM floor), the LoRA overhead, base / LoRA over the default's")
    for b in batches:
        base, lora = f["base"]["tpot_s"][b], f["lora"]["tpot_s"][b]
        vb, vl = f[f"base_{variant}"]["tpot_s"][b], f[f"lora_{variant}"]["tpot_s"][b]
        line = f"  batch {b:>3}: default base {base * ms:6.2f} ({base / floor:.2f}) lora {lora * ms:6.2f}"
        line += f" {100 * (lora / base - 1):+5.1f}% | {variant} base {vb * ms:6.2f} ({vb / floor:.2f})"
        line += f" lora {vl * ms:6.2f} ({vl / floor:.2f}) {100 * (vl / vb - 1):+5.1f}%"
        print(line + f" | x{vb / base:.3f} / x{vl / lora:.3f}")


def print_overlap(f: dict, batches: list[int]) -> None:
    """TPOT with overlapped steps beside steps one at a time (EngineConfig.overlap_steps), base and LoRA."""
    if "lora_other_overlap" not in f:
        return
    ms, floor = 1e3, f["hbm_floor_tpot_s"]
    on = {"base": "base", "lora": "lora"}
    off = {"base": "base_other_overlap", "lora": "lora_other_overlap"}
    if not f["overlap_steps"]:
        on, off = off, on
    print("\noverlapped steps vs steps one at a time (overlap_steps): TPOT ms (over the HBM floor), the LoRA")
    print("overhead over the same mode's base, and overlapped / one at a time")
    for b in batches:
        line = f"  batch {b:>3}:"
        for label, names in (("overlapped", on), ("one at a time", off)):
            base, lora = f[names["base"]]["tpot_s"][b], f[names["lora"]]["tpot_s"][b]
            line += f" {label} base {base * ms:6.2f} ({base / floor:.2f}) lora {lora * ms:6.2f}"
            line += f" ({lora / floor:.2f}) {100 * (lora / base - 1):+5.1f}% |"
        ratio = [f[on[k]]["tpot_s"][b] / f[off[k]]["tpot_s"][b] for k in ("base", "lora")]
        print(line + f" x{ratio[0]:.3f} / x{ratio[1]:.3f}")
    ttft = [f[names["lora"]]["ttft_s"] * ms for names in (on, off)]
    print(f"  LoRA TTFT: overlapped {ttft[0]:.1f} ms, one at a time {ttft[1]:.1f} ms")


def print_prefill_graphs(f: dict) -> None:
    """TTFT with prefill CUDA graphs beside the eager prefill, base and LoRA, and what the graphs cost."""
    if "lora_pg" not in f:
        return
    ms = 1e3
    base, lora, base_pg, lora_pg = (f[n]["ttft_s"] for n in ("base", "lora", "base_pg", "lora_pg"))
    buckets, n = f["prefill_graph_tokens"], f["prompt_len"]
    print(f"\nprefill CUDA graphs (buckets {buckets} tokens), TTFT of a {n}-token prompt:")
    print(f"  eager: base {base * ms:.1f} ms, lora {lora * ms:.1f} ms (lora/base {lora / base:.3f})")
    print(
        f"  graph: base {base_pg * ms:.1f} ms, lora {lora_pg * ms:.1f} ms (lora/base "
        f"{lora_pg / base_pg:.3f}; lora graph / base eager {lora_pg / base:.3f}; "
        f"replays {f.get('lora_pg_prefill_replays', 0)})"
    )
    for m in f["expand_modes"]:
        eager_m, graph_m = f[f"lora_{m}"]["ttft_s"], f[f"lora_pg_{m}"]["ttft_s"]
        print(
            f"  lora_expand {m}: eager {eager_m * ms:.1f} ms, graph {graph_m * ms:.1f} ms (graph lora/base "
            f"{graph_m / base_pg:.3f}; replays {f.get(f'lora_pg_{m}_prefill_replays', 0)})"
        )
    capture = f.get("lora_pg_prefill_capture_s", 0.0)
    start = f.get("lora_pg_reserved_bytes", 0) - f.get("lora_reserved_bytes", 0)
    after = f.get("lora_pg_reserved_after_bytes", 0) - f.get("lora_reserved_after_bytes", 0)
    print(
        f"  capture {capture:.2f} s (lora); torch reserved against lora eager: {start / 2**20:+.0f} MiB at "
        f"start, {after / 2**20:+.0f} MiB after the TTFT prefills (eager: their cached activations)"
    )


def print_shrinks(f: dict, batches: list[int]) -> None:
    """The LoRA shrink variants (--lora-shrinks) beside the default's: TTFT eager (and with prefill graphs),
    chunked-prefill tokens/s, each against the base's."""
    ms = 1e3
    base = f["base"]
    for k in f["shrink_variants"]:
        print(f"\nlora_shrink {k} beside {f['lora_shrink']} (lora/base in brackets):")
        for mode in [None, *f["expand_modes"]]:
            ref = "lora" if mode is None else f"lora_{mode}"
            var = f"lora_shrink_{k}" if mode is None else f"lora_{mode}_shrink_{k}"
            label = f["lora_expand"] if mode is None else mode
            a, b = f[ref]["ttft_s"], f[var]["ttft_s"]
            line = f"  {label}: TTFT eager {a * ms:.1f} -> {b * ms:.1f} ms ({a / base['ttft_s']:.3f} -> "
            line += f"{b / base['ttft_s']:.3f})"
            ref_pg = "lora_pg" if mode is None else f"lora_pg_{mode}"
            var_pg = f"lora_pg_shrink_{k}" if mode is None else f"lora_pg_{mode}_shrink_{k}"
            if var_pg in f:
                a, b, bpg = f[ref_pg]["ttft_s"], f[var_pg]["ttft_s"], f["base_pg"]["ttft_s"]
                line += f"; graph {a * ms:.1f} -> {b * ms:.1f} ms ({a / bpg:.3f} -> {b / bpg:.3f})"
            print(line)
            for bt in batches:
                if bt in f[var]["prefill_tokens_per_s"]:
                    a, b = f[ref]["prefill_tokens_per_s"][bt], f[var]["prefill_tokens_per_s"][bt]
                    bb = base["prefill_tokens_per_s"][bt]
                    rates = f"{a:8.0f} -> {b:8.0f} tokens/s ({a / bb:.3f} -> {b / bb:.3f})"
                    print(f"    chunked prefill batch {bt:>3}: {rates}")


def print_prefill_throughput(f: dict, batches: list[int], loras: list[tuple[str, dict]]) -> None:
    """Chunked prefill (`chunked_prefill_rate`): a batch of prompts, one token each, in chunks of
    max_num_batched_tokens a step; prompt tokens a second."""
    budget = f["max_num_batched_tokens"]
    print(f"chunked prefill, tokens/s (prompts of {f['prompt_len']}, a step's token budget {budget}):")
    for b in batches:
        base = f["base"]["prefill_tokens_per_s"][b]
        line = f"  batch {b:>3}: base {base:8.0f}"
        for name, r in loras:
            if b in r["prefill_tokens_per_s"]:  # the other modes run the large batches only
                tps = r["prefill_tokens_per_s"][b]
                line += f", {name} {tps:8.0f} (lora/base {tps / base:.3f})"
        print(line)
    print()


def print_table(f: dict, batches: list[int], tiny: bool) -> None:
    ms = 1e3
    print(f"\nlorafn engine benchmark — {f['device']}, {f['dtype']}, model {f['model']}")
    print(
        f"prompt {f['prompt_len']} tokens, {f['decode_tokens']} decode steps, "
        f"LoRA rank {f['rank']} {f.get('targets', 'all-linear')}"
    )
    print(
        f"weights {f['weight_bytes'] / 1e9:.2f} GB, copy bandwidth {f['copy_bandwidth_Bps'] / 1e9:.0f} GB/s, "
        f"HBM floor TPOT {f['hbm_floor_tpot_s'] * ms:.3f} ms"
    )
    print(f"graph capture: base {f['base_graph_capture_s']:.2f} s, lora {f['lora_graph_capture_s']:.2f} s\n")
    hf = f.get("hf_peft")
    default = f"lora ({f['lora_expand']})"
    others = [(f"lora ({m})", f[f"lora_{m}"]) for m in f["expand_modes"]]
    loras = [(default, f["lora"]), *others]
    if not tiny:
        print(
            f"TTFT (prompt {f['prompt_len']}): base {f['base']['ttft_s'] * ms:.1f} ms, "
            + ", ".join(f"{name} {r['ttft_s'] * ms:.1f} ms" for name, r in loras)
            + (f", hf+peft {hf['ttft_s'] * ms:.1f} ms" if hf else "")
        )
        short = {"per_projection": "per_proj", "in_kernels": "in_kern"}
        labels = [name[6:-1] for name, _r in others]
        for long, abbrev in short.items():
            labels = [label.replace(long, abbrev) for label in labels]
        other_cols = "".join(f" {label[:16]:>16}" for label in labels)
        header = (
            f"{'batch':>5} | {'TPOT base ms':>12} {'TPOT lora ms':>12}{other_cols} {'hf+peft ms':>10} | "
            f"{'tok/s base':>10} {'tok/s lora':>10} {'tok/s hf':>9}"
        )
        print(f"TPOT ms; lora = {default}; other lora_expand modes where they differ (batch > 16)")
        print(header)
        print("-" * len(header))
        for b in batches:
            hf_tpot = f"{hf['tpot_s'][b] * ms:10.2f}" if hf else f"{'-':>10}"
            hf_tps = f"{hf['tokens_per_s'][b]:9.0f}" if hf else f"{'-':>9}"
            extra = "".join(
                f" {r['tpot_s'][b] * ms:16.2f}" if b in r["tpot_s"] else f" {'-':>16}" for _n, r in others
            )
            print(
                f"{b:>5} | {f['base']['tpot_s'][b] * ms:12.2f} "
                f"{f['lora']['tpot_s'][b] * ms:12.2f}{extra} {hf_tpot} | "
                f"{f['base']['tokens_per_s'][b]:10.0f} {f['lora']['tokens_per_s'][b]:10.0f} {hf_tps}"
            )
        print()
    print_prefill_throughput(f, batches, loras)
    print(
        "ratios (issue 12 targets: TTFT lora/base <= 1.1; lora TPOT@1 / floor <= 1.25; "
        "LoRA overhead <= 5% at batch 1-8, <= 3% at 32-64; lora tok/s / hf >= 3 at batch 32)"
    )
    for name, r in loras:
        print(f"  TTFT lora/base, {name}: {r['ttft_s'] / f['base']['ttft_s']:.3f}")
    print(
        f"  TPOT@{batches[0]} lora / HBM floor: {f['lora']['tpot_s'][batches[0]] / f['hbm_floor_tpot_s']:.2f}"
        f"  (base: {f['base']['tpot_s'][batches[0]] / f['hbm_floor_tpot_s']:.2f})"
    )
    for b in batches:
        overhead = 100 * (f["lora"]["tpot_s"][b] / f["base"]["tpot_s"][b] - 1)
        kv_floor = f["floor_with_kv_s"][b]
        line = f"  batch {b:>3}: LoRA overhead {overhead:+6.1f}%; over the weights + KV floor"
        base, lora = f["base"]["tpot_s"][b], f["lora"]["tpot_s"][b]
        line += f" ({kv_floor * ms:.2f} ms) base {base / kv_floor:.2f} lora {lora / kv_floor:.2f}"
        for name, r in others:
            if b in r["tpot_s"]:
                line += f" ({name}: {100 * (r['tpot_s'][b] / f['base']['tpot_s'][b] - 1):+.1f}%)"
        if hf:
            line += f", lora tok/s vs hf+peft {f['lora']['tokens_per_s'][b] / hf['tokens_per_s'][b]:6.2f}x"
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
