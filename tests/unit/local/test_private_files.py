"""Files that hold secrets are written 0600, also over an older file of a wider mode (issue 15)."""

from __future__ import annotations

import stat
from pathlib import Path

from lorafn.local.demo import demo_manifest, write_demo_manifest


def test_the_demo_manifest_holding_api_keys_is_private(tmp_path: Path) -> None:
    old = tmp_path / "demo.yaml"
    old.write_text("left by an older version")
    old.chmod(0o644)
    text = demo_manifest(
        tmp_path / "model", tmp_path / "adapters", {"french": "lfn-secret", "gsm8k": "lfn-2"}
    )
    path = write_demo_manifest(tmp_path, text)
    assert path == old
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "lfn-secret" in path.read_text()
