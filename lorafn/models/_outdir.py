"""Checks on an output directory shared by `lorafn model pull` and `lorafn model random`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


class AssetError(RuntimeError):
    """A model asset could not be made; the message says what to change. The CLI prints it and exits 2."""


# Files a finished model directory holds; a directory holding only these may be overwritten.
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".jinja", ".txt", ".model")


def prepare_out_dir(out: Path, *, required_bytes: int, overwrite: bool = False) -> Path:
    """Make `out` ready to receive a model directory of about `required_bytes`, or raise AssetError.

    Refused: `out` is a file; `out` (or its nearest existing parent) is not writable; `out` is a
    non-empty directory holding anything but model files (model files only with `overwrite`); the
    file system lacks `required_bytes` plus a 5% margin.
    """
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise AssetError(f"--out {out} is a file, not a directory; give a directory path")
    if out.is_dir():
        entries = [p for p in out.iterdir() if p.name not in {".lorafn-complete", ".lock"}]
        if entries:
            foreign = [p.name for p in entries if p.is_dir() or not p.name.endswith(MODEL_FILE_SUFFIXES)]
            if foreign:
                raise AssetError(
                    f"--out {out} is a non-empty directory with files that are not a model's "
                    f"({', '.join(sorted(foreign)[:5])}); give an empty or new directory"
                )
            if not overwrite:
                raise AssetError(
                    f"--out {out} already holds a model directory; pass --overwrite to replace it"
                )
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise AssetError(f"--out {out}: {existing} is not writable")
    free = shutil.disk_usage(existing).free
    needed = int(required_bytes * 1.05) + (1 << 20)
    if free < needed:
        raise AssetError(
            f"not enough disk space for {out}: need {needed / 2**30:.2f} GiB, "
            f"{free / 2**30:.2f} GiB free on the file system of {existing}"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AssetError(f"--out {out}: cannot create the directory ({e.strerror})") from e
    if overwrite:
        for p in out.iterdir():
            if p.is_file():
                p.unlink()
    return out
