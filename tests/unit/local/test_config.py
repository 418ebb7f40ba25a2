"""The local platform's config: the fields every component shares come from the one settings base."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafn.api.settings import SharedSettings, env_name
from lorafn.local.config import LocalConfig, load_config


def test_local_config_reads_the_shared_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(env_name("key_prefix"), "p7")
    monkeypatch.setenv(env_name("heartbeat_ttl_s"), "9")
    monkeypatch.setenv(env_name("cache_dir"), str(tmp_path))
    config = LocalConfig()
    assert (config.key_prefix, config.heartbeat_ttl_s, config.cache_dir) == ("p7", 9.0, tmp_path)
    assert issubclass(LocalConfig, SharedSettings)


def test_yaml_overrides_env_and_bad_values_name_the_field(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(env_name("key_prefix"), "from-env")
    path = tmp_path / "lorafn.yaml"
    path.write_text("key_prefix: from-file\nheartbeat_ttl_s: 3\n")
    config = load_config(path)
    assert (config.key_prefix, config.heartbeat_ttl_s) == ("from-file", 3.0)
    path.write_text("heartbeat_ttl_s: 0\n")
    with pytest.raises(ValueError, match="heartbeat_ttl_s"):
        load_config(path)


def test_batch_kv_is_lent_by_default_on_a_gpu_only() -> None:
    """KV for offline batches (docs/batch.md#kv-from-idle-memory): 16 GiB by default on a GPU, none on CPU,
    the setting wherever it is given (0: off)."""
    from lorafn.local.config import LocalConfig

    assert LocalConfig().batch_kv_bytes("cuda") == 16384 << 20
    assert LocalConfig().batch_kv_bytes("cpu") == 0
    assert LocalConfig(batch_kv_mib=8).batch_kv_bytes("cpu") == 8 << 20
    assert LocalConfig(batch_kv_mib=0).batch_kv_bytes("cuda") == 0


def test_burst_kv_is_off_by_default_and_checked() -> None:
    """KV for bursts (PolicyConfig.burst_kv_bytes): off until measured on a GPU; a negative budget is refused
    with the field named (the same field type as the controller's LORAFN_BURST_KV_MIB)."""
    from pydantic import ValidationError

    from lorafn.local.config import LocalConfig

    assert LocalConfig().burst_kv_mib == 0 and LocalConfig(burst_kv_mib=1024).burst_kv_mib == 1024
    with pytest.raises(ValidationError, match="burst_kv_mib"):
        LocalConfig(burst_kv_mib=-1)


def test_scale_up_on_wait_is_off_by_default_and_checked() -> None:
    from pydantic import ValidationError

    from lorafn.local.config import LocalConfig

    assert LocalConfig().scale_up_wait_fraction is None
    assert LocalConfig(scale_up_wait_fraction=0.2).scale_up_wait_fraction == 0.2
    for bad in (0, 1.5):
        with pytest.raises(ValidationError, match="scale_up_wait_fraction"):
            LocalConfig(scale_up_wait_fraction=bad)
