"""The restore self-check's pure parts (lorafn/runtime/graph_restore.py): the output digest is the documented
pair of position-weighted word sums mod 2^64 (checked against a plain-Python computation, on CPU tensors:
the GPU runs the same integer arithmetic), any single changed bit changes it, and the self-check modes pick
the buckets they name."""

from __future__ import annotations

import struct

import pytest

torch = pytest.importorskip("torch")

from lorafn.runtime.graph_restore import _DIGEST_K, output_digest, selfcheck_buckets  # noqa: E402

MASK = (1 << 64) - 1


def _reference(data: bytes) -> list[int]:
    words = struct.unpack(f"<{len(data) // 4}i", data)
    out = []
    for mul, add in _DIGEST_K:
        s = 0
        for i, w in enumerate(words):
            s = (s + w * (((i * mul + add) & MASK) | 1)) & MASK
        out.append(s)
    return out


def test_the_digest_is_the_documented_word_sums_and_sees_every_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 33, generator=gen, dtype=torch.float32)
    digest = [v & MASK for v in output_digest(logits).tolist()]
    assert digest == _reference(logits.numpy().tobytes())
    assert [v & MASK for v in output_digest(logits.clone()).tolist()] == digest
    words = logits.view(torch.int32).view(-1)
    for index in (0, 77, words.numel() - 1):
        for bit in (0, 17, 31):
            flipped = words.clone()
            flipped[index] ^= 1 << bit if bit < 31 else -(1 << 31)
            other = [v & MASK for v in output_digest(flipped.view(torch.float32).view(4, 33)).tolist()]
            assert other[0] != digest[0] and other[1] != digest[1], (index, bit)
    swapped = logits.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same words in another order: another digest
    assert [v & MASK for v in output_digest(swapped).tolist()] != digest


def test_selfcheck_modes_pick_their_buckets() -> None:
    assert selfcheck_buckets("all", [4, 1, 2]) == [1, 2, 4]
    assert selfcheck_buckets(True, [4, 1]) == [1, 4]
    assert selfcheck_buckets("one", [4, 1, 2]) == [1]
    assert selfcheck_buckets("none", [4, 1]) == [] == selfcheck_buckets(False, [1])
    funcs = {1: {"rms", "gemv"}, 2: {"rms", "gemv"}, 4: {"rms"}, 32: {"rms", "nvjet_a"}, 64: {"nvjet_a"}}
    assert selfcheck_buckets("cover", [64, 32, 4, 2, 1], funcs) == [1, 32]  # each function replayed once
    with pytest.raises(ValueError, match="needs the functions"):
        selfcheck_buckets("cover", [1])
    with pytest.raises(
        ValueError, match=r"selfcheck: 'some' is not one of \('all', 'cover', 'one', 'none'\)"
    ):
        selfcheck_buckets("some", [1])
