"""A function pointing at another function's adapter directory, judged on real paths (issue 15)."""

from __future__ import annotations

from pathlib import Path

from lorafn.api.adapters import shared_adapter_dirs


def test_the_same_directory_through_a_symlink_or_dotdot_is_found(tmp_path: Path) -> None:
    a = tmp_path / "tenant-a" / "adapter"
    a.mkdir(parents=True)
    link = tmp_path / "tenant-b-adapter"
    link.symlink_to(a)
    (tmp_path / "tenant-b").mkdir()
    found = shared_adapter_dirs(
        {"ns/a": str(a), "ns/b": str(link), "ns/c": f"{tmp_path}/tenant-b/../tenant-a/adapter"}
    )
    assert set(found) == {"ns/a", "ns/b", "ns/c"}
    assert f"really {a}" in found["ns/b"] and "ns/a" in found["ns/b"]
    assert f"really {a}" in found["ns/c"]


def test_a_directory_inside_another_functions_is_found(tmp_path: Path) -> None:
    (tmp_path / "a" / "sub").mkdir(parents=True)
    found = shared_adapter_dirs({"ns/a": str(tmp_path / "a"), "ns/b": str(tmp_path / "a" / "sub")})
    assert "overlaps" in found["ns/b"] and "overlaps" in found["ns/a"]


def test_separate_directories_are_fine(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "ab").mkdir()  # a prefix of the name, not a parent directory
    assert shared_adapter_dirs({"ns/a": str(tmp_path / "a"), "ns/b": str(tmp_path / "ab")}) == {}
