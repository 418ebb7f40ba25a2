"""bf16 under Triton's interpreter, as the GPU computes it. Import before any kernel runs, in a process with
TRITON_INTERPRET=1 (the patch is process-wide; only tests import it).

The interpreter keeps bf16 tensors as uint16 (numpy has no bf16) and gets two things wrong for them: `tl.dot`
multiplies the raw uint16 bits, and a float32 -> bf16 cast truncates the mantissa. On the GPU a bf16 dot
multiplies exactly and accumulates in float32 (the tensor cores; `wgmma` on an H100) and `.to(tl.bfloat16)`
rounds to nearest even (`cvt.rn.bf16x2.f32`). Patched here: bf16 dot operands are widened to float32 exactly,
and every cast to or from bf16 goes through float32 with torch's round-to-nearest-even. So the CPU tests can
check the kernels' bf16 roundings (test_expand_rounding.py)."""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

_cast = interpreter.InterpreterBuilder.cast_impl
_dot = interpreter.InterpreterBuilder.create_dot


def _widen(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32 values, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _round(values: np.ndarray) -> np.ndarray:
    """float32 values -> bf16 bits (uint16), rounded to nearest even."""
    shape = np.shape(values)
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(-1)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16).reshape(shape)


def _cast_impl(self, src, dst_type):
    s, d = src.dtype.scalar, dst_type.scalar
    if s == tl.bfloat16 and d != tl.bfloat16:
        wide = interpreter.TensorHandle(_widen(src.data), tl.float32)
        return wide if d == tl.float32 else _cast(self, wide, dst_type)
    if d == tl.bfloat16 and s != tl.bfloat16:
        wide = src if s == tl.float32 else _cast(self, src, tl.float32)
        return interpreter.TensorHandle(_round(wide.data), d)
    return _cast(self, src, dst_type)


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.scalar == tl.bfloat16:
        a = interpreter.TensorHandle(_widen(a.data), tl.float32)
    if b.dtype.scalar == tl.bfloat16:
        b = interpreter.TensorHandle(_widen(b.data), tl.float32)
    return _dot(self, a, b, d, input_precision, max_num_imprecise_acc)


interpreter.InterpreterBuilder.cast_impl = _cast_impl
interpreter.InterpreterBuilder.create_dot = _create_dot
