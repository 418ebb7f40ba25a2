"""seg_linear's tile fitting: where Triton's compiler refuses a tile for want of shared memory
(OutOfResources, raised before anything is launched; a prologue's tiles take more than seg_config counts,
seen on an H200), seg_linear takes the next smaller tile, remembers it for that kernel variant, and gives
up with the compiler's error below the smallest. The compiler is stood in for here (its refusal needs a
GPU's limits: tests/gpu/test_fused_decode_gpu.py runs the real one at 33-64 rows with every prologue)."""

from __future__ import annotations

import pytest
import torch

fd = pytest.importorskip("lorafn.runtime.models.fused_decode")
from triton.runtime.errors import OutOfResources  # noqa: E402  (after the importorskip)


class _Compiler:
    """Stands in for `_seg_gemm_kernel[grid]`: refuses tiles whose (stages - 1) x BLOCK_K is above `fits`
    (a shared-memory limit in those units), else writes ones into every output and records the tile."""

    def __init__(self, fits: int) -> None:
        self.fits, self.tried, self.ran = fits, [], []

    def __getitem__(self, grid):
        def launch(*args, BLOCK_M, BLOCK_K, num_stages, **_kw):
            tile = (BLOCK_M, BLOCK_K, num_stages)
            self.tried.append(tile)
            if (num_stages - 1) * BLOCK_K > self.fits:
                raise OutOfResources((num_stages - 1) * BLOCK_K, self.fits, "shared memory")
            for y in args[5:9]:
                y.fill_(1.0)
            self.ran.append(tile)

        return launch


@pytest.fixture
def compiler(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(fd, "_FITTED", {})

    def install(fits: int) -> _Compiler:
        c = _Compiler(fits)
        monkeypatch.setattr(fd, "_seg_gemm_kernel", c)
        return c

    return install


def test_a_refused_tile_is_shrunk_and_remembered(compiler) -> None:
    c = compiler(fits=192)  # 64 rows of K 4096: seg_config's (64, 128, 3) takes 256 units
    x, w = torch.randn(40, 4096), torch.randn(64, 4096)
    assert fd.seg_config(40, 4096) == (64, 128, 3)
    (y,) = fd.seg_linear(x, [w], prologue=fd.SiluMulPrologue(torch.randn(40, 4096)))
    assert torch.equal(y, torch.ones(40, 64))
    assert c.tried == [(64, 128, 3), (64, 64, 3)] and c.ran == [(64, 64, 3)]
    silu = fd.PRO_SILU_MUL.value
    fitted = {"tile": [64, 128, 3], "prologue": silu, "expands": False, "fitted": [64, 64, 3]}
    assert fd.fitted_tiles() == [fitted]
    fd.seg_linear(x, [w], prologue=fd.SiluMulPrologue(torch.randn(40, 4096)))  # the fitted tile at once
    assert c.tried[2:] == [(64, 64, 3)]
    fd.seg_linear(x, [w])  # another variant (no prologue) starts from seg_config's tile again
    assert c.tried[3:] == [(64, 128, 3), (64, 64, 3)]


def test_stages_go_after_the_reduction_tile_then_the_error_is_raised(compiler) -> None:
    assert fd._smaller_tile((16, 256, 4)) == (16, 128, 4)
    assert fd._smaller_tile((16, 32, 4)) == (16, 32, 3)
    assert fd._smaller_tile((16, 32, 2)) is None
    c = compiler(fits=16)  # nothing fits: the compiler's own error, after every smaller tile was tried
    with pytest.raises(OutOfResources):
        fd.seg_linear(torch.randn(2, 4096), [torch.randn(32, 4096)])
    assert c.tried[-1] == (16, 32, 2) and c.ran == []
