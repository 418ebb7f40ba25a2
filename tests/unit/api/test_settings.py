"""The shared settings base: one definition of what components must agree on, read from LORAFN_*."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafn.api.settings import SharedSettings, default_cache_dir, env_name


def test_env_sets_every_shared_field(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    values = {
        "redis_url": "redis://h:1/2",
        "key_prefix": "p1",
        "heartbeat_ttl_s": "7.5",
        "cache_dir": str(tmp_path),
    }
    for field, value in values.items():
        monkeypatch.setenv(env_name(field), value)
    s = SharedSettings()
    assert (s.redis_url, s.key_prefix, s.heartbeat_ttl_s, s.cache_dir) == (
        "redis://h:1/2",
        "p1",
        7.5,
        tmp_path,
    )


def test_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LORAFN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "lorafn"
    assert SharedSettings().cache_dir == tmp_path / "lorafn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "lorafn"


def test_bad_ttl_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAFN_HEARTBEAT_TTL_S", "0")
    with pytest.raises(ValueError, match="heartbeat_ttl_s"):
        SharedSettings()
