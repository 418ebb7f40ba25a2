"""The paged KV cache: one allocation; per layer k/v views [num_blocks + 1, block_size, kv_heads, head_dim].

Block `num_blocks` (the last) is a scratch block that the block manager never hands out: padded rows of
a CUDA-graph bucket write their K/V there and read it back, so padding never touches a real sequence.

Sizing (DESIGN §1.5, Medusa's KV-init materialization): the number of blocks comes from
`num_kv_blocks`, or a byte budget, or, on CUDA without either, from one profiling forward whose answer
is saved as a small JSON keyed by everything it depends on, and reused on the next start without
running the forward again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from lorafn.runtime.config import ModelConfig

CPU_DEFAULT_MAX_BYTES = 2 << 30


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, keys and values."""
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def blocks_for_budget(budget_bytes: int, per_block: int) -> int:
    return max(0, int(budget_bytes) // per_block)


def cpu_default_blocks(max_num_seqs: int, max_model_len: int, block_size: int, per_block: int) -> int:
    """Enough blocks for every sequence at full length, capped at CPU_DEFAULT_MAX_BYTES."""
    want = max_num_seqs * -(-max_model_len // block_size)
    return max(1, min(want, CPU_DEFAULT_MAX_BYTES // per_block))


class KVCache:
    """k/v tensors of every layer in one zero-filled allocation (zeros: padded reads stay finite)."""

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks: need at least 1 KV block, got {num_blocks}")
        self.cfg, self.num_blocks, self.block_size = cfg, num_blocks, block_size
        self.scratch_block = num_blocks
        self.data = torch.zeros(
            cfg.num_layers,
            2,
            num_blocks + 1,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            device=device,
            dtype=dtype,
        )
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.data[i, 0], self.data[i, 1]) for i in range(cfg.num_layers)
        ]

    def resized(self, num_blocks: int) -> KVCache:
        """A cache of ``num_blocks`` blocks holding this one's blocks ``0 .. min(old, new) - 1`` (the rest
        zeros): `ModelRunner.resize_kv`. The caller drops this one (both are held while copying)."""
        cfg = self.cfg
        new = KVCache(cfg, num_blocks, self.block_size, self.data.device, self.data.dtype)
        keep = min(self.num_blocks, num_blocks)
        new.data[:, :, :keep].copy_(self.data[:, :, :keep])
        return new

    @property
    def scratch_slot(self) -> int:
        return self.scratch_block * self.block_size

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    # --- KV offload (kv_offload.py): a preempted sequence's blocks to host memory and back ---------------
    # Both copies are enqueued on the current stream before the step's forward (non-blocking from/to pinned
    # memory on CUDA), so they are ordered with it: a block swapped out is read before the forward
    # overwrites it, and a swap-in lands before the forward reads it. One layer at a time, so the device
    # temporary of the gather is 1/num_layers of the sequence's KV, not all of it.

    def swap_out(self, blocks: list[int]) -> torch.Tensor:
        """Copy ``blocks`` to host memory: [num_layers, 2, len(blocks), block_size, kv_heads, head_dim]."""
        device = self.data.device
        index = torch.tensor(blocks, dtype=torch.int64, device=device)
        num_layers, _, _, *rest = self.data.shape
        host = torch.empty(
            (num_layers, 2, len(blocks), *rest), dtype=self.data.dtype, pin_memory=device.type == "cuda"
        )
        for layer in range(num_layers):
            host[layer].copy_(self.data[layer].index_select(1, index), non_blocking=True)
        return host

    def swap_in(self, host: torch.Tensor, blocks: list[int]) -> None:
        """Copy a `swap_out` result back into ``blocks`` (the same count, any ids)."""
        if host.shape[2] != len(blocks):
            raise ValueError(f"blocks: {len(blocks)} given for a host copy of {host.shape[2]} blocks")
        device = self.data.device
        index = torch.tensor(blocks, dtype=torch.int64, device=device)
        for layer in range(host.shape[0]):
            self.data[layer].index_copy_(1, index, host[layer].to(device, non_blocking=True))


# --- KV-init materialization -------------------------------------------------------------------------


def kv_init_key(fields: dict[str, Any]) -> str:
    """A stable hash of what the profiled size depends on (model, dtype, device, budget, software)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:24]


def kv_init_path(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / "kv_init" / f"{key}.json"


def load_kv_init(cache_dir: Path, key: str) -> int | None:
    """The remembered number of blocks, or None when there is none (or it is unreadable)."""
    path = kv_init_path(cache_dir, key)
    try:
        data = json.loads(path.read_text())
        num_blocks = int(data["num_blocks"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return num_blocks if num_blocks > 0 else None


def save_kv_init(cache_dir: Path, key: str, num_blocks: int, fields: dict[str, Any]) -> Path:
    """Write atomically (rename) so that concurrent starts never read half a file."""
    path = kv_init_path(cache_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(
        json.dumps({"num_blocks": num_blocks, "fields": fields}, sort_keys=True, default=str, indent=1)
    )
    tmp.replace(path)
    return path
