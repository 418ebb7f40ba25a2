"""The operator's config inherits the shared settings and reads them under its own prefix."""

from __future__ import annotations

import pytest

from lorafn.api.settings import SharedSettings, env_name
from lorafn.operator.config import OperatorConfig


def test_operator_reads_shared_fields_under_its_own_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart sets LORAFN_OPERATOR_REDIS_URL/KEY_PREFIX/HEARTBEAT_TTL_S; the pods get LORAFN_*."""
    monkeypatch.setenv("LORAFN_OPERATOR_REDIS_URL", "redis://r:1/0")
    monkeypatch.setenv("LORAFN_OPERATOR_KEY_PREFIX", "k")
    monkeypatch.setenv("LORAFN_OPERATOR_HEARTBEAT_TTL_S", "2.5")
    monkeypatch.setenv(env_name("key_prefix"), "not-the-operators")
    assert issubclass(OperatorConfig, SharedSettings)
    config = OperatorConfig()
    assert (config.redis_url, config.key_prefix, config.heartbeat_ttl_s) == ("redis://r:1/0", "k", 2.5)
