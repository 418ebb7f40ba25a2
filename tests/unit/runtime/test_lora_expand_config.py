"""EngineConfig.lora_expand: the three modes are accepted, anything else is refused naming the field."""

from __future__ import annotations

import pytest

from lorafn.runtime.config import LORA_EXPANDS, EngineConfig


def test_lora_expand_modes() -> None:
    assert LORA_EXPANDS[0] == "per_projection" == EngineConfig(model="m").lora_expand  # the default
    for mode in LORA_EXPANDS:
        assert EngineConfig(model="m", lora_expand=mode).lora_expand == mode
    with pytest.raises(ValueError, match="lora_expand: 'fused'"):
        EngineConfig(model="m", lora_expand="fused")
