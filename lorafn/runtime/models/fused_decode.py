"""Kernels of a small-batch step (decode) on CUDA (Triton): few launches, LoRA at almost no extra cost.

Measured on the H100 (bench/decode_profile.py, llama-2-7b, batch 1): a decode step of the base model
ran 677 kernels, the same step with an r16 all-linear adapter 1157; the 352 LoRA GEMMs (a shrink per
projection group, an expand per projection) and their 128 split-K reduces cost 1.25 ms on top of the
base's 6.66 ms replay, ~3 µs each whatever their size. Here a step of at most `MAX_TOKENS` rows runs:

- `seg_linear`: one skinny GEMM launch over several weight matrices that read the same input, e.g.
  [A_qkv, W_q, W_k, W_v]: the LoRA shrink t = x·A_catᵀ is just more output rows of the same launch
  (its programs first, they read the most per program). Tiles are read once at full width; no split-K.
  It also serves steps of up to `MAX_GEMM_ROWS` rows (EngineConfig.skinny_gemm_rows: decode batches of
  32-64), where it read the 7B's groups faster than cuBLAS (bench/gemv_probe.py --rows); the per-row
  kernels below stay at `MAX_TOKENS` rows.
- `rope_lora_kv`: the q/k/v expands (y += t·Bᵀ), RoPE on q and k, and the K/V cache writes, in one
  launch (replaces 3 expands, 2 RoPE kernels and 2 index_copy kernels).
- `silu_mul_lora`: the gate/up expands fused into SiLU·up.
- the o_proj and down_proj expands fused into the next residual add + RMSNorm
  (`triton_ops.add_rms_norm(..., lora=...)`).
- or, with EngineConfig.expand_in_gemm, every expand inside `seg_linear` itself (`expands=`): the other
  programs wait for the shrink's and add t·B to their own columns (`_seg_gemm_kernel`), and the kernels above
  get none; on an H200 the replay was 2-5.5% faster so and TPOT 0.7-2.1% (docs/benchmarks.md): the default.
- and, with EngineConfig.gemm_prologue_rows, `seg_linear(..., prologue=)` computes its own input from the
  tensors the kernel before it read: the residual add + RMSNorm (`NormPrologue`) or SiLU·up
  (`SiluMulPrologue`), so that a layer's norms and SiLU take no launch of their own.

Rounding: each expand is summed in float32, added to its projection's output in float32 and rounded once to
the activation dtype (as `addmm_` does on a CPU; cuBLAS's bf16 `addmm_` on the H100 appears to round the
product first, docs/runtime.md), and everything after it rounds as triton_ops does. B is kept transposed
([r, out], contiguous) so that an expand reads rows of it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from lorafn.runtime.config import SKINNY_GEMM_MAX_ROWS
from lorafn.runtime.triton_rounding import rope_sum

log = logging.getLogger(__name__)

MAX_TOKENS = 16  # rows of a step whose LoRA expands the per-row kernels below add (a decode step)
MAX_GEMM_ROWS = SKINNY_GEMM_MAX_ROWS  # rows `seg_linear` takes (its tile height: 16, 32 or 64)
BLOCK_N = 32  # output rows (features) per program
# rows of A_cat per shrink program of a skinny GEMM with its expands inside: half a tile, so that the shrink's
# programs finish first and the others find t ready when their products end (`_seg_gemm_kernel`); on the H200
# 16 was at least as fast as 32 at 1-64 rows and faster than 8 at 1-16 (bench/seg_expand_probe.py --shrink-n)
SHRINK_N = 16
MAX_SEGMENTS = 4
# `_seg_gemm_kernel`'s PROLOGUE: what its input X becomes before the product (`seg_linear(..., prologue=)`)
PRO_NONE, PRO_NORM, PRO_ADD_NORM, PRO_SILU_MUL = (tl.constexpr(code) for code in range(4))


@dataclass(frozen=True)
class Expand:
    """One projection's LoRA expand: t[:, offset:offset+rank] · b_t ([rank, out] contiguous).

    With `row_slots` ([T] int64, adapter slots: lora.py) rank is one slot's and b_t holds every slot's
    rows: row i adds t[i, offset + s·rank : +rank] · b_t[s·rank : +rank] for its slot s = row_slots[i], so
    the per-row kernels read one slot's rank rows of B, not all of them (and unroll over one rank)."""

    t: torch.Tensor  # [T, sum of the group's ranks]
    offset: int
    rank: int
    b_t: torch.Tensor
    row_slots: torch.Tensor | None = None


@dataclass(frozen=True)
class NormPrologue:
    """`seg_linear`'s input is RMSNorm(x + delta)·weight (delta None: RMSNorm(x)·weight), and `residual`
    ([M, K], given with delta) receives x + delta: triton_ops.add_rms_norm's add + norm inside the GEMM."""

    weight: torch.Tensor  # [K]
    eps: float
    delta: torch.Tensor | None = None
    residual: torch.Tensor | None = None


@dataclass(frozen=True)
class SiluMulPrologue:
    """`seg_linear`'s input is SiLU(x)·up (x: the gate projection's output): triton_ops.silu_mul inside it."""

    up: torch.Tensor  # [M, K]


Prologue = NormPrologue | SiluMulPrologue


def block_k(k: int) -> int | None:
    """The reduction tile for an input width: the largest of 256..32 that divides it (None: none does)."""
    return next((b for b in (256, 128, 64, 32) if k % b == 0), None)


# tl.dot's precision per activation dtype: float32 models (the exactness tests) get IEEE float32, not tf32
DOT_PRECISION = {torch.bfloat16: "tf32", torch.float16: "tf32", torch.float32: "ieee"}


@triton.jit
def _seg_gemm_kernel(
    X,
    W0,
    W1,
    W2,
    W3,
    Y0,
    Y1,
    Y2,
    Y3,
    N0,
    N1,
    N2,
    N3,
    M,
    K,
    stride_xm,
    FLAGS,
    ROW_SLOTS,
    BT1,
    BT2,
    BT3,
    OFF1,
    OFF2,
    OFF3,
    RANK1,
    RANK2,
    RANK3,
    X2,
    stride_x2m,
    NORM_W,
    H_OUT,
    EPS,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    EXPAND: tl.constexpr = False,
    R: tl.constexpr = 0,
    SLOTTED: tl.constexpr = False,
    RP: tl.constexpr = 16,
    PROLOGUE: tl.constexpr = 0,
    SHRINK_N: tl.constexpr = 32,
):
    """Y_i = X·W_iᵀ for each segment i, one program per BLOCK_N output features of one segment.

    EXPAND (`seg_linear(..., expands=...)`): segment 0 is the group's LoRA shrink t = X·A_catᵀ and each
    other segment i adds its expand t[:, OFF_i : OFF_i + RANK_i]·BT_i (BT_i [rank, N_i]; SLOTTED: each row's
    slot s = ROW_SLOTS[row] picks t's columns OFF_i + s·RANK_i.. and BT_i's rows s·RANK_i..) to its product,
    rounded first to Y's dtype as the per-row kernels get it, the sum rounded once (one adapter: t's tile
    times the B tile as one tl.dot, B read before the product's loop; slots: rank by rank).

    The shrink's programs are the grid's first, SHRINK_N rows of A_cat each (fewer than BLOCK_N, so that
    they finish before the others): each stores its tile of t, then counts itself into FLAGS[0] (a release
    at GPU scope after a CTA barrier); the others compute their product, wait until every shrink program
    has counted (acquire), read t from L2 and add the expand. FLAGS[0] must be zero when the launch starts
    and is left at the number of shrink programs: whoever launches again on it zeroes it first, in stream
    order (the model zeroes all its counters at once at the start of a step, one fill). A counter left
    stale makes the waits pass early (wrong t, never a hang); nothing in the launch resets it, so its
    programs end as the base GEMM's do, with no ticket to draw at the end (the form before the
    twenty-sixth session drew one to reset itself, a round trip to L2 at every waiting program's end:
    +1.2-2.4 µs a launch over the base GEMM against +0.4-1.3 now, bench/seg_expand_probe.py). Programs
    are dispatched in grid order, so the shrink's run first (or with) the waiting ones and the wait ends;
    each waiting program reads only its BLOCK_N columns of B, so the expands are spread over the whole grid
    instead of one program per row.

    PROLOGUE (`seg_linear(..., prologue=...)`, EngineConfig.gemm_prologue_rows): what X becomes before the
    product, computed by every program from X's tiles as triton_ops' kernels would have written it (same
    roundings; the norm's sum of squares in float32, tile by tile): PRO_NORM, RMSNorm(X)·NORM_W; PRO_ADD_NORM,
    RMSNorm(X + X2)·NORM_W, the program of pid 0 also storing X + X2 (the residual) to H_OUT; PRO_SILU_MUL,
    SiLU(X)·X2. The norms read X (and X2) twice: once for the sum of squares, once in the product's loop."""
    pid = tl.program_id(0)
    end0 = tl.cdiv(N0, SHRINK_N)  # SHRINK_N == BLOCK_N without expands
    end1 = end0 + tl.cdiv(N1, BLOCK_N)
    end2 = end1 + tl.cdiv(N2, BLOCK_N)
    w = W0
    y = Y0
    n = N0
    first = 0
    bt = BT1
    off = 0
    rank = 0
    if pid >= end0:  # an unused segment has N = 0: its end is the grid's, no pid reaches it
        w = W1
        y = Y1
        n = N1
        first = end0
        bt = BT1
        off = OFF1
        rank = RANK1
    if pid >= end1:
        w = W2
        y = Y2
        n = N2
        first = end1
        bt = BT2
        off = OFF2
        rank = RANK2
    if pid >= end2:
        w = W3
        y = Y3
        n = N3
        first = end2
        bt = BT3
        off = OFF3
        rank = RANK3
    # a shrink program takes SHRINK_N rows of A_cat, the rest of its BLOCK_N-row tile masked off (not read)
    shrink = pid < end0
    cols = tl.arange(0, BLOCK_N)
    rn = tl.where(shrink, pid * SHRINK_N, (pid - first) * BLOCK_N) + cols
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = (rn < n) & (cols < tl.where(shrink, SHRINK_N, BLOCK_N))
    m_ok = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if EXPAND and not SLOTTED:  # this program's columns of B, read while the product streams W
        rr = tl.arange(0, RP)
        r_ok = rr < rank
        b_tile = tl.load(bt + rr[:, None] * n + rn[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    adt = X.dtype.element_ty  # the activations' dtype
    inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # each row's 1 / RMS, before the product's loop (`in` is not Triton's)
    if PROLOGUE == PRO_NORM or PROLOGUE == PRO_ADD_NORM:  # noqa: SIM109
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xs = _prologue_input(
                X, X2, stride_xm, stride_x2m, rm, m_ok, k0 + rk, PROLOGUE == PRO_ADD_NORM, adt
            )
            xs = xs.to(tl.float32)
            squares += tl.sum(xs * xs, axis=1)
        inv_rms = tl.rsqrt(squares / K + EPS)
    for k0 in range(0, K, BLOCK_K):
        if PROLOGUE == PRO_NONE:
            x = tl.load(X + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        elif PROLOGUE == PRO_SILU_MUL:  # SiLU(gate)·up, rounded as triton_ops.silu_mul
            g = tl.load(X + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
            u = tl.load(X2 + rm[:, None] * stride_x2m + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
            g = g.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(adt).to(tl.float32)
            x = (act * u.to(tl.float32)).to(adt)
        else:  # the (residual +) RMSNorm, rounded as triton_ops.add_rms_norm
            x = _prologue_input(
                X, X2, stride_xm, stride_x2m, rm, m_ok, k0 + rk, PROLOGUE == PRO_ADD_NORM, adt
            )
            # one program writes the residual h + delta, for the next layer (a compile-time test, then a
            # run-time one: Triton's jit does not mix them in one `and`)
            if PROLOGUE == PRO_ADD_NORM:  # noqa: SIM102
                if pid == 0:
                    tl.store(H_OUT + rm[:, None] * K + (k0 + rk)[None, :], x, mask=m_ok[:, None])
            normed = (x.to(tl.float32) * inv_rms[:, None]).to(adt).to(tl.float32)
            nw = tl.load(NORM_W + k0 + rk).to(tl.float32)
            x = (nw[None, :] * normed).to(adt)
        wt = tl.load(w + rn[None, :].to(tl.int64) * K + (k0 + rk)[:, None], mask=n_ok[None, :], other=0.0)
        acc += tl.dot(x, wt, input_precision=PRECISION)
    out_mask = m_ok[:, None] & n_ok[None, :]
    if not EXPAND:
        tl.store(y + rm[:, None] * n + rn[None, :], acc.to(y.dtype.element_ty), mask=out_mask)
    elif pid < end0:  # a tile of the shrink t: stored, then released to the waiting programs
        tl.store(y + rm[:, None] * n + rn[None, :], acc.to(y.dtype.element_ty), mask=out_mask)
        tl.debug_barrier()
        tl.atomic_add(FLAGS, 1, sem="release", scope="gpu")
    else:
        dt = y.dtype.element_ty
        out = acc.to(dt).to(tl.float32)  # the product rounded, as the per-row kernels read it
        arrived = tl.atomic_add(FLAGS, 0, sem="acquire", scope="gpu")
        while arrived < end0:
            arrived = tl.atomic_add(FLAGS, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        if SLOTTED:  # each row its slot's columns of t and rows of B, rank by rank
            slot = tl.load(ROW_SLOTS + rm, mask=m_ok, other=0).to(tl.int64)
            t_col = off + slot * rank  # [BLOCK_M] t's first column of each row's expand
            b_row = slot * rank  # [BLOCK_M] BT's first row of each row's expand
            for j in tl.static_range(R):
                ok = m_ok & ((rm * 0 + j) < rank)  # this projection's rank may be below the group's widest
                tj = tl.load(Y0 + rm * N0 + t_col + j, mask=ok, other=0.0, cache_modifier=".cg")
                tj = tj.to(tl.float32)
                bj = tl.load(
                    bt + (b_row + j)[:, None] * n + rn[None, :], mask=ok[:, None] & n_ok[None, :], other=0.0
                ).to(tl.float32)  # [BLOCK_M, BLOCK_N]
                out += tj[:, None] * bj
        else:  # one adapter: t's [BLOCK_M, RP] tile (zeros past the rank) · the B tile read before
            t_tile = tl.load(
                Y0 + rm[:, None] * N0 + off + rr[None, :],
                mask=m_ok[:, None] & r_ok[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            out += tl.dot(t_tile, b_tile, input_precision=PRECISION)
        tl.store(y + rm[:, None] * n + rn[None, :], out.to(dt), mask=out_mask)


@triton.jit
def _prologue_input(X, X2, stride_xm, stride_x2m, rm, m_ok, cols, ADD: tl.constexpr, adt: tl.constexpr):
    """[BLOCK_M, BLOCK_K] of X (ADD: X + X2, rounded to the activations' dtype as torch adds them)."""
    x = tl.load(X + rm[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None], other=0.0)
    if ADD:
        d = tl.load(X2 + rm[:, None] * stride_x2m + cols[None, :], mask=m_ok[:, None], other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(adt)
    return x


# shared memory the segmented GEMM's pipelined tiles may take per program (the H100 allows 227 KiB): a float32
# model's 64-row tiles at 4 stages of 256 columns did not fit (Triton OutOfResources)
SEG_SMEM_BYTES = 192 << 10


def seg_config(m: int, k: int, element_size: int = 2) -> tuple[int, int, int] | None:
    """(BLOCK_M, BLOCK_K, num_stages) of `seg_linear` for M rows of width K (None: no reduction tile divides
    K). The fastest of bench/gemv_probe.py --rows on the H100 for the 7B's groups in bf16, within ~1 µs per
    group: tiles of 16 or 32 rows read 256 columns (the largest tile dividing K) in 4 stages; of 64 rows, 128
    columns in 3 stages where the input is 4096 wide (q/k/v, o, gate/up, head), 256 in 4 for down_proj's
    11008. Wider elements (float32) take narrower tiles, then fewer stages, until the pipelined tiles
    ((stages - 1) x (BLOCK_M + BLOCK_N) x BLOCK_K elements) fit SEG_SMEM_BYTES."""
    bk = block_k(k)
    if bk is None:
        return None
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    stages = 4
    if block_m == 64 and k <= 4096:
        bk, stages = min(bk, 128), 3
    while (stages - 1) * (block_m + BLOCK_N) * bk * element_size > SEG_SMEM_BYTES:
        if bk > 32:
            bk //= 2  # still divides K: bk was the largest power-of-two tile that does
        elif stages > 2:
            stages -= 1
        else:
            break
    return block_m, bk, stages


def seg_flags(device: torch.device | str, sites: int = 1) -> torch.Tensor:
    """[sites] int32 counters for `seg_linear(..., expands=...)`, one per launch between two zeroings: a
    launch counts its shrink programs into its counter (`seg_linear`'s flags: one element of these), which
    must be zero when it starts. The model keeps one per expand launch of a step (its layers' LoRA groups)
    and zeroes them all at the start of each step (one fill, in stream order before the step's launches).
    Made once per model, before any CUDA graph capture (their address is in the graphs)."""
    if sites < 1:
        raise ValueError(f"seg_flags: at least one counter, got {sites}")
    return torch.zeros(sites, dtype=torch.int32, device=device)


def shrink_programs(shrink_rows: int, shrink_n: int | None = None) -> int:
    """The programs of `seg_linear`'s shrink (A_cat's rows / SHRINK_N): what a launch with expands leaves in
    its counter."""
    return triton.cdiv(shrink_rows, shrink_n or SHRINK_N)


def seg_linear(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    expands: list[tuple[int, int, torch.Tensor] | None] | None = None,
    row_slots: torch.Tensor | None = None,
    flags: torch.Tensor | None = None,
    prologue: Prologue | None = None,
    shrink_n: int | None = None,
) -> list[torch.Tensor]:
    """[x·W_iᵀ for each W_i] in one launch; x [M, K] (rows may be strided, M <= MAX_GEMM_ROWS), each W_i
    [N_i, K] contiguous. Returns contiguous [M, N_i] tensors.

    `expands` (LoRA, one group): weights[0] is the group's A_cat (its output the shrink t), and each other
    weight's (offset, rank, b_t) or None: its expand t[:, offset:offset+rank]·b_t is added inside the same
    launch (the kernel's docstring), rounded as the per-row kernels add it. `row_slots` ([M] int64, adapter
    slots): rank is one slot's, b_t holds every slot's rows, each row reads its own slot's. `flags`: one
    int32 counter (an element of `seg_flags`), zero when the launch starts; the launch leaves it at
    `shrink_programs(A_cat rows)`. `shrink_n`: A_cat rows per shrink program (default SHRINK_N; a bench
    knob). `prologue`: what x becomes before the product (NormPrologue, SiluMulPrologue), each
    program computing it from x's tiles (the kernel's docstring)."""
    m, k = x.shape
    code, x2, norm_w, h_out, eps = _prologue_args(prologue, x)
    if not 1 <= len(weights) <= MAX_SEGMENTS:
        raise ValueError(f"seg_linear: 1..{MAX_SEGMENTS} weights, got {len(weights)}")
    if expands is not None and (len(expands) != len(weights) - 1 or flags is None):
        raise ValueError(
            f"seg_linear: {len(weights)} weights take {len(weights) - 1} expands and the model's flags, "
            f"got {len(expands)} expands, flags {flags is not None}"
        )
    if flags is not None and (flags.dtype != torch.int32 or flags.numel() < 1 or flags.device != x.device):
        raise ValueError(
            f"seg_linear: flags must be an int32 counter on {x.device}, got {flags.dtype} "
            f"{tuple(flags.shape)} on {flags.device}"
        )
    shrink_n = (shrink_n or SHRINK_N) if expands is not None else BLOCK_N
    if not 1 <= shrink_n <= BLOCK_N or shrink_n & (shrink_n - 1):
        raise ValueError(f"seg_linear: shrink_n must be a power of two in 1..{BLOCK_N}, got {shrink_n}")
    config = seg_config(m, k, x.element_size())
    if m > MAX_GEMM_ROWS or config is None or x.stride(1) != 1:
        raise ValueError(f"seg_linear: x {tuple(x.shape)} stride {x.stride()} is not a supported shape")
    outs = [torch.empty(m, w.shape[0], device=x.device, dtype=x.dtype) for w in weights]
    ws = list(weights) + [weights[0]] * (MAX_SEGMENTS - len(weights))
    ys = outs + [outs[0]] * (MAX_SEGMENTS - len(outs))
    ns = [w.shape[0] for w in weights] + [0] * (MAX_SEGMENTS - len(weights))
    grid = (triton.cdiv(ns[0], shrink_n) + sum(triton.cdiv(n, BLOCK_N) for n in ns[1:]),)
    spec = list(expands or ()) + [None] * (MAX_SEGMENTS - 1 - len(expands or ()))
    bts = [e[2] if e is not None else x for e in spec]
    offs = [e[0] if e is not None else 0 for e in spec]
    ranks = [e[1] if e is not None else 0 for e in spec]
    rp = max(16, triton.next_power_of_2(max(ranks)))

    def launch(block_m: int, bk: int, stages: int) -> None:
        _seg_gemm_kernel[grid](
            x,
            *ws,
            *ys,
            *ns,
            m,
            k,
            x.stride(0),
            flags if flags is not None else x,
            row_slots if row_slots is not None else x,
            *bts,
            *offs,
            *ranks,
            x2,
            x2.stride(0),
            norm_w,
            h_out,
            eps,
            EXPAND=expands is not None,
            R=max(ranks),
            SLOTTED=row_slots is not None,
            RP=rp,
            BLOCK_M=block_m,
            BLOCK_N=BLOCK_N,
            BLOCK_K=bk,
            PRECISION=DOT_PRECISION[x.dtype],
            num_warps=4,
            num_stages=stages,
            PROLOGUE=code,
            SHRINK_N=shrink_n,
        )

    variant = (config, code, expands is not None, row_slots is not None, rp, x.dtype, x.device, shrink_n)
    config = _FITTED.get(variant, config)
    while True:
        try:
            launch(*config)
            return outs
        except OutOfResources as err:  # raised by the compiler, before anything is launched
            smaller = _smaller_tile(config)
            if smaller is None:
                raise
            log.info("seg_linear: tile %s %s; taking %s", config, err, smaller)
            _FITTED[variant] = config = smaller


# (seg_config's tile, PROLOGUE, expands, slotted, RP, dtype, device, SHRINK_N) -> the tile that variant runs
# with where seg_config's did not fit the GPU's shared memory (seg_config counts the product's tiles only; on
# the H200 the SiLU prologue's (64, 256, 4) needed 262144 of 232448 bytes)
_FITTED: dict[tuple, tuple[int, int, int]] = {}


def fitted_tiles() -> list[dict]:
    """The tiles `seg_linear` shrank to fit so far in this process (bench/decode_profile.py prints them):
    seg_config's tile, the variant's PROLOGUE code and whether it had expands, and the tile it runs with."""
    return [
        {"tile": list(key[0]), "prologue": key[1], "expands": key[2], "fitted": list(tile)}
        for key, tile in _FITTED.items()
    ]


def _smaller_tile(config: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """The next smaller (BLOCK_M, BLOCK_K, num_stages): half the reduction tile (it still divides K) down
    to 32 columns, then a stage fewer down to 2; None below that."""
    block_m, bk, stages = config
    if bk > 32:
        return block_m, bk // 2, stages
    if stages > 2:
        return block_m, bk, stages - 1
    return None


def _prologue_args(
    prologue: Prologue | None, x: torch.Tensor
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(PROLOGUE code, X2, NORM_W, H_OUT, EPS) of `_seg_gemm_kernel` for `seg_linear`'s prologue; x stands in
    for the tensors a prologue does not use (never read)."""
    m, k = x.shape

    def check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device or t.stride(-1) != 1:
            raise ValueError(
                f"seg_linear: the prologue's {name} {tuple(t.shape)} {t.dtype} on {t.device} (stride "
                f"{t.stride()}) does not match x {tuple(x.shape)} {x.dtype} on {x.device}"
            )
        return t

    if prologue is None:
        return PRO_NONE.value, x, x, x, 0.0
    if isinstance(prologue, SiluMulPrologue):
        return PRO_SILU_MUL.value, check("up", prologue.up, (m, k)), x, x, 0.0
    weight = check("weight", prologue.weight, (k,))
    if (prologue.delta is None) != (prologue.residual is None):
        raise ValueError("seg_linear: a NormPrologue takes delta and residual together, or neither")
    if prologue.delta is None:
        return PRO_NORM.value, x, weight, x, float(prologue.eps)
    delta = check("delta", prologue.delta, (m, k))
    residual = check("residual", prologue.residual, (m, k))  # type: ignore[arg-type]
    if not residual.is_contiguous():
        raise ValueError(
            f"seg_linear: the prologue's residual must be contiguous, stride {residual.stride()}"
        )
    return PRO_ADD_NORM.value, delta, weight, residual, float(prologue.eps)


@triton.jit
def lora_add_tile(
    acc,
    T,
    row,
    stride_t,
    off,
    rank,
    BT,
    out_features,
    cols,
    mask,
    R: tl.constexpr,
    ROW_SLOTS,
    SLOTTED: tl.constexpr,
):
    """acc + t[row, off:off+rank] · B_t[:, cols] in float32 (B_t: [rank, out_features]; rank <= R).
    SLOTTED (adapter slots, `Expand.row_slots`): the row's slot s = ROW_SLOTS[row] picks t's columns
    off + s·rank.. and B_t's rows s·rank.. (rank: one slot's).

    Unrolled over R so that every load is in flight at once: a loop over a run-time rank issued them one
    after another and made the expands ~10x slower than their bytes (H100, bench/decode_profile.py)."""
    if SLOTTED:
        s = tl.load(ROW_SLOTS + row).to(tl.int64)
        off = off + s * rank
        BT = BT + s * rank * out_features
    for j in tl.static_range(R):
        ok = mask & ((cols * 0 + j) < rank)  # this projection's rank may be below the group's widest
        tj = tl.load(T + row * stride_t + off + j + cols * 0, mask=ok, other=0.0).to(tl.float32)
        acc += tj * tl.load(BT + j * out_features + cols, mask=ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _head_with_lora(
    ROW,
    T,
    t,
    stride_t,
    off,
    rank,
    BT,
    out_f,
    cols,
    mask,
    HALF: tl.constexpr,
    dt: tl.constexpr,
    HAS_LORA: tl.constexpr,
    R: tl.constexpr,
    ROW_SLOTS,
    SLOTTED: tl.constexpr,
):
    """One head's two halves of a projection's output row (ROW: the row's start), its LoRA expand added
    and rounded to the activation dtype as the unfused addmm_ does; float32 values."""
    x1 = tl.load(ROW + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ROW + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_LORA:
        x1 = lora_add_tile(x1, T, t, stride_t, off, rank, BT, out_f, cols, mask, R, ROW_SLOTS, SLOTTED)
        x1 = x1.to(dt).to(tl.float32)
        x2 = lora_add_tile(x2, T, t, stride_t, off, rank, BT, out_f, cols + HALF, mask, R, ROW_SLOTS, SLOTTED)
        x2 = x2.to(dt).to(tl.float32)
    return x1, x2


@triton.jit
def _rope_half_pair(x1, x2, c1, c2, s1, s2, dt: tl.constexpr):
    """RoPE of one head's two halves, each product and the sum rounded like the torch ops (rope_sum: no
    product fused into an FMA on the GPU)."""
    return rope_sum(x1, c1, -x2, s1, dt), rope_sum(x2, c2, x1, s2, dt)


@triton.jit
def _rope_lora_kv_kernel(
    Q,
    K,
    V,
    QO,
    KO,
    VO,
    KC,
    VC,
    SLOTS,
    COS,
    SIN,
    POS,
    TQ,
    TK,
    TV,
    BQ,
    BK,
    BV,
    stride_q,
    stride_k,
    stride_v,
    stride_tq,
    stride_tk,
    stride_tv,
    off_q,
    off_k,
    off_v,
    rank_q,
    rank_k,
    rank_v,
    num_heads,
    num_kv_heads,
    ROW_SLOTS,
    HAS_LORA: tl.constexpr,
    R: tl.constexpr,
    SLOTTED: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    dt = QO.dtype.element_ty
    head_dim = 2 * HALF
    pos = tl.load(POS + t).to(tl.int64)
    c1 = tl.load(COS + pos * head_dim + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + pos * head_dim + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + pos * head_dim + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + pos * head_dim + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if h < num_heads:
        out_f = num_heads * head_dim
        cols = h * head_dim + offs
        x1, x2 = _head_with_lora(Q + t * stride_q, TQ, t, stride_tq, off_q, rank_q, BQ, out_f, cols, mask,
                                 HALF, dt, HAS_LORA, R, ROW_SLOTS, SLOTTED)  # fmt: skip
        o1, o2 = _rope_half_pair(x1, x2, c1, c2, s1, s2, dt)
        base = QO + t * (num_heads * head_dim) + h * head_dim
        tl.store(base + offs, o1, mask=mask)
        tl.store(base + HALF + offs, o2, mask=mask)
    else:
        j = h - num_heads
        out_f = num_kv_heads * head_dim
        cols = j * head_dim + offs
        k1, k2 = _head_with_lora(K + t * stride_k, TK, t, stride_tk, off_k, rank_k, BK, out_f, cols, mask,
                                 HALF, dt, HAS_LORA, R, ROW_SLOTS, SLOTTED)  # fmt: skip
        v1, v2 = _head_with_lora(V + t * stride_v, TV, t, stride_tv, off_v, rank_v, BV, out_f, cols, mask,
                                 HALF, dt, HAS_LORA, R, ROW_SLOTS, SLOTTED)  # fmt: skip
        o1, o2 = _rope_half_pair(k1, k2, c1, c2, s1, s2, dt)
        slot = tl.load(SLOTS + t).to(tl.int64)
        k_out = KO + t * out_f + j * head_dim
        k_cached = KC + slot * out_f + j * head_dim
        tl.store(k_out + offs, o1, mask=mask)
        tl.store(k_out + HALF + offs, o2, mask=mask)
        tl.store(k_cached + offs, o1, mask=mask)
        tl.store(k_cached + HALF + offs, o2, mask=mask)
        v_out = VO + t * out_f + j * head_dim
        v_cached = VC + slot * out_f + j * head_dim
        tl.store(v_out + offs, v1.to(dt), mask=mask)
        tl.store(v_out + HALF + offs, v2.to(dt), mask=mask)
        tl.store(v_cached + offs, v1.to(dt), mask=mask)
        tl.store(v_cached + HALF + offs, v2.to(dt), mask=mask)


def max_rank(expands: tuple[Expand | None, ...] | Expand | None) -> int:
    """The unroll width of the expands' rank loop (a compile-time constant of the kernels)."""
    if isinstance(expands, Expand):
        return expands.rank
    return max((e.rank for e in expands or () if e is not None), default=0)


def lora_args(expand: Expand | None, like: torch.Tensor) -> tuple:
    """(t, b_t, t's row stride, offset, rank): a kernel's expand arguments; without an expand, `like` as
    both pointers and rank 0 (every load of a rank-0 expand is masked off: nothing is read)."""
    if expand is None:
        return like, like, 0, 0, 0
    return expand.t, expand.b_t, expand.t.stride(0), expand.offset, expand.rank


def slot_args(expands: tuple[Expand | None, ...] | Expand | None, like: torch.Tensor) -> tuple:
    """(ROW_SLOTS, SLOTTED) of a launch: the row slots the expands share (adapter slots), else `like` and
    False. The expands of one group come from one step: one row_slots tensor, or none."""
    if isinstance(expands, Expand):
        expands = (expands,)
    slots = {id(e.row_slots): e.row_slots for e in expands or () if e is not None and e.row_slots is not None}
    if not slots:
        return like, False
    if len(slots) > 1:
        raise ValueError("expands of one launch with different row_slots tensors")
    return next(iter(slots.values())), True


def rope_lora_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lora: tuple[Expand | None, Expand | None, Expand | None] | None,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H·D], k, v [T, Hkv·D] (projection outputs, rows may be strided) -> (q, k, v) as [T, heads,
    D]: the LoRA expands added (lora: one Expand or None per projection), q and k rotated, and k, v also
    stored at `slot_mapping` [T] of the caches ([blocks, block_size, Hkv, D] each)."""
    tokens = q.shape[0]
    head_dim = cos.shape[-1]
    qo = torch.empty(tokens, num_heads, head_dim, device=q.device, dtype=q.dtype)
    ko = torch.empty(tokens, num_kv_heads, head_dim, device=q.device, dtype=q.dtype)
    vo = torch.empty_like(ko)
    eq, ek, ev = lora if lora is not None else (None, None, None)
    tq, bq, stq, oq, rq = lora_args(eq, q)
    tk, bk, stk, ok, rk = lora_args(ek, q)
    tv, bv, stv, ov, rv = lora_args(ev, q)
    row_slots, slotted = slot_args(lora, positions)
    half = head_dim // 2
    _rope_lora_kv_kernel[(tokens, num_heads + num_kv_heads)](
        q,
        k,
        v,
        qo,
        ko,
        vo,
        k_cache,
        v_cache,
        slot_mapping,
        cos,
        sin,
        positions,
        tq,
        tk,
        tv,
        bq,
        bk,
        bv,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        stq,
        stk,
        stv,
        oq,
        ok,
        ov,
        rq,
        rk,
        rv,
        num_heads,
        num_kv_heads,
        row_slots,
        HAS_LORA=lora is not None,
        R=max_rank(lora),
        SLOTTED=slotted,
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
        num_warps=1,
    )
    return qo, ko, vo


@triton.jit
def _silu_mul_lora_kernel(
    G,
    U,
    OUT,
    TG,
    TU,
    BG,
    BU,
    stride_g,
    stride_u,
    stride_tg,
    stride_tu,
    off_g,
    off_u,
    rank_g,
    rank_u,
    N,
    ROW_SLOTS,
    HAS_LORA: tl.constexpr,
    R: tl.constexpr,
    SLOTTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dt = OUT.dtype.element_ty
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_LORA:
        g = lora_add_tile(g, TG, row, stride_tg, off_g, rank_g, BG, N, cols, mask, R, ROW_SLOTS, SLOTTED)
        g = g.to(dt).to(tl.float32)
        u = lora_add_tile(u, TU, row, stride_tu, off_u, rank_u, BU, N, cols, mask, R, ROW_SLOTS, SLOTTED)
        u = u.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(OUT + row * N + cols, (act * u).to(dt), mask=mask)


def silu_mul_lora(
    gate: torch.Tensor, up: torch.Tensor, lora: tuple[Expand | None, Expand | None] | None
) -> torch.Tensor:
    """silu(gate + t·B_gateᵀ) * (up + t·B_upᵀ) for gate, up [T, N] (rows may be strided); [T, N]."""
    tokens, n = gate.shape
    out = torch.empty(tokens, n, device=gate.device, dtype=gate.dtype)
    eg, eu = lora if lora is not None else (None, None)
    tg, bg, stg, og, rg = lora_args(eg, gate)
    tu, bu, stu, ou, ru = lora_args(eu, gate)
    row_slots, slotted = slot_args(lora, gate)
    block = 1024 if lora is None else 256  # with expands: more programs, each reading fewer B rows
    _silu_mul_lora_kernel[(tokens, triton.cdiv(n, block))](
        gate,
        up,
        out,
        tg,
        tu,
        bg,
        bu,
        gate.stride(0),
        up.stride(0),
        stg,
        stu,
        og,
        ou,
        rg,
        ru,
        n,
        row_slots,
        HAS_LORA=lora is not None,
        R=max_rank(lora),
        SLOTTED=slotted,
        BLOCK=block,
        num_warps=4,
    )
    return out
