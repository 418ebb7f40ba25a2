"""prepare_out_dir: the checks every model-writing command runs on --out."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from lorafn.models import _outdir
from lorafn.models._outdir import AssetError, prepare_out_dir


def test_new_and_empty_directories_are_accepted(tmp_path: Path) -> None:
    assert prepare_out_dir(tmp_path / "a" / "b", required_bytes=1).is_dir()
    (tmp_path / "empty").mkdir()
    assert prepare_out_dir(tmp_path / "empty", required_bytes=1) == tmp_path / "empty"


def test_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(AssetError, match="is a file, not a directory"):
        prepare_out_dir(tmp_path / "f", required_bytes=1)


def test_unrelated_content_is_refused_even_with_overwrite(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("mine")
    with pytest.raises(AssetError, match=r"non-empty directory .*notes\.md"):
        prepare_out_dir(tmp_path, required_bytes=1, overwrite=True)
    assert (tmp_path / "notes.md").exists()


def test_a_previous_model_needs_overwrite(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(AssetError, match="--overwrite"):
        prepare_out_dir(tmp_path, required_bytes=1)
    prepare_out_dir(tmp_path, required_bytes=1, overwrite=True)
    assert not (tmp_path / "config.json").exists()


def test_not_writable_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(_outdir.os, "access", lambda p, mode: Path(p) != tmp_path)
    with pytest.raises(AssetError, match="is not writable"):
        prepare_out_dir(tmp_path / "model", required_bytes=1)


def test_uncreatable_directory_is_refused(tmp_path: Path, monkeypatch) -> None:
    def denied(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(AssetError, match=r"cannot create the directory \(Permission denied"):
        prepare_out_dir(tmp_path / "model", required_bytes=1)


def test_not_enough_space_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AssetError, match=r"not enough disk space .* need .* GiB free"):
        prepare_out_dir(tmp_path / "m", required_bytes=10**18)
    assert not (tmp_path / "m").exists()
