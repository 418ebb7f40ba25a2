"""own_adapter_dirs: one adapter directory per function over a few shared random adapters, as hard links."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lorafn.replay.platform import own_adapter_dirs


def _adapter(root: Path, name: str, payload: bytes) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text('{"r": 4}')
    (d / "adapter_model.safetensors").write_bytes(payload)
    return d


def test_each_function_gets_its_own_directory_linked_to_its_adapter(tmp_path: Path) -> None:
    shared = [_adapter(tmp_path / "src", "a0", b"zero"), _adapter(tmp_path / "src", "a1", b"one")]
    functions = ["replay/f000", "replay/f001", "replay/f002"]
    dirs = own_adapter_dirs(shared, functions, tmp_path / "fn")
    assert [d.name for d in dirs] == ["replay-f000", "replay-f001", "replay-f002"]
    assert len({d.resolve() for d in dirs}) == 3
    # f002 has a0's files, as the same inodes (no copy)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert os.path.samefile(dirs[2] / name, shared[0] / name)
    assert (dirs[1] / "adapter_model.safetensors").read_bytes() == b"one"
    # again, and with another mapping: idempotent, and a changed mapping replaces the links
    assert own_adapter_dirs(shared, functions, tmp_path / "fn") == dirs
    again = own_adapter_dirs(shared[1:], functions, tmp_path / "fn")
    assert (again[0] / "adapter_model.safetensors").read_bytes() == b"one"
    assert (shared[0] / "adapter_model.safetensors").read_bytes() == b"zero"  # the source is untouched


def test_no_adapters_is_an_error_naming_the_argument(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="adapters"):
        own_adapter_dirs([], ["replay/f000"], tmp_path)
