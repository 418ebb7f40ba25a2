"""EngineConfig.skinny_gemm_rows, gemm_prologue_rows, decode_attention and rope_in_attention; the segmented
GEMM tiles (fused_decode.seg_config)."""

from __future__ import annotations

import pytest

from lorafn.runtime import EngineConfig
from lorafn.runtime.config import (
    DECODE_ATTENTION_KERNELS,
    DEFAULT_DECODE_ATTENTION,
    DEFAULT_GEMM_PROLOGUE_ROWS,
    DEFAULT_ROPE_IN_ATTENTION,
    DEFAULT_SKINNY_GEMM_ROWS,
    SKINNY_GEMM_MAX_ROWS,
)


@pytest.mark.parametrize("rows", [0, -1, SKINNY_GEMM_MAX_ROWS + 1])
def test_rows_out_of_range_are_refused_naming_the_field(rows: int) -> None:
    with pytest.raises(ValueError, match=r"skinny_gemm_rows: must be in \[1, 64\], got"):
        EngineConfig(model="m", skinny_gemm_rows=rows)


def test_default_and_bounds_are_accepted() -> None:
    assert EngineConfig(model="m").skinny_gemm_rows == DEFAULT_SKINNY_GEMM_ROWS
    assert EngineConfig(model="m", skinny_gemm_rows=SKINNY_GEMM_MAX_ROWS).skinny_gemm_rows == 64


@pytest.mark.parametrize("rows", [-1, SKINNY_GEMM_MAX_ROWS + 1])
def test_prologue_rows_out_of_range_are_refused_naming_the_field(rows: int) -> None:
    with pytest.raises(ValueError, match=rf"gemm_prologue_rows: must be in \[0, 64\], got {rows}"):
        EngineConfig(model="m", gemm_prologue_rows=rows)


def test_prologue_rows_default_and_bounds_are_accepted() -> None:
    assert EngineConfig(model="m").gemm_prologue_rows == DEFAULT_GEMM_PROLOGUE_ROWS
    for rows in (0, 1, SKINNY_GEMM_MAX_ROWS):
        assert EngineConfig(model="m", gemm_prologue_rows=rows).gemm_prologue_rows == rows


def test_seg_config_tiles() -> None:
    fd = pytest.importorskip("lorafn.runtime.models.fused_decode")
    assert fd.MAX_GEMM_ROWS == SKINNY_GEMM_MAX_ROWS
    # (BLOCK_M, BLOCK_K, stages): 16 or 32 rows read 256 columns in 4 stages
    assert fd.seg_config(1, 4096) == (16, 256, 4)
    assert fd.seg_config(16, 11008) == (16, 256, 4)
    assert fd.seg_config(17, 4096) == (32, 256, 4)
    # 64 rows: 128 columns in 3 stages over a 4096-wide input, 256 in 4 over down_proj's 11008
    assert fd.seg_config(33, 4096) == (64, 128, 3)
    assert fd.seg_config(64, 11008) == (64, 256, 4)
    assert fd.seg_config(64, 96) == (64, 32, 3)  # the tiny preset's width: its largest tile
    assert fd.seg_config(8, 4100) is None  # no tile divides it: seg_linear refuses it
    # float32: narrower tiles until the pipelined tiles fit the shared memory (64 rows x 256 x 4 stages did
    # not on the H100); the bf16 choices above fit as they are
    assert fd.seg_config(16, 11008, 4) == (16, 256, 4)  # 3 x 48 x 256 x 4 B = 144 KiB: fits
    assert fd.seg_config(48, 11008, 4) == (64, 128, 4)
    assert fd.seg_config(32, 4096, 4) == (32, 256, 4)
    for m in (1, 17, 33, 64):
        for k in (4096, 11008):
            bm, bk, stages = fd.seg_config(m, k, 4)
            assert (stages - 1) * (bm + fd.BLOCK_N) * bk * 4 <= fd.SEG_SMEM_BYTES
            assert k % bk == 0


def test_decode_attention_kernel_is_checked_naming_the_field() -> None:
    assert EngineConfig(model="m").decode_attention == DEFAULT_DECODE_ATTENTION
    for kernel in DECODE_ATTENTION_KERNELS:
        assert EngineConfig(model="m", decode_attention=kernel).decode_attention == kernel
    with pytest.raises(ValueError, match=r"decode_attention: 'mma' is not one of \('simt', 'dot'\)"):
        EngineConfig(model="m", decode_attention="mma")


def test_rope_in_attention_is_a_bool_naming_the_field() -> None:
    assert EngineConfig(model="m").rope_in_attention is DEFAULT_ROPE_IN_ATTENTION
    assert EngineConfig(model="m", rope_in_attention=True).rope_in_attention is True
    with pytest.raises(ValueError, match=r"rope_in_attention: must be true or false, got 'yes'"):
        EngineConfig(model="m", rope_in_attention="yes")  # type: ignore[arg-type]
