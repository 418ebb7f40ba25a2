"""`--configs`'s help is built from the configurations themselves: none is missing from it."""

from __future__ import annotations

from typer.testing import CliRunner

from lorafn.cli import app
from lorafn.replay.configs import CONFIGS, DEFAULT_CONFIGS, configs_help


def test_every_configuration_is_in_the_help_with_its_brief() -> None:
    text = configs_help()
    for config in CONFIGS.values():
        assert config.brief, config.name
        assert f"{config.name} ({config.brief})" in text
    left_out = text.split("'default' = all but ", 1)[1].split(";", 1)[0]
    assert set(left_out.split(", ")) == set(CONFIGS) - set(DEFAULT_CONFIGS)


def test_the_cli_shows_it() -> None:
    shown = CliRunner().invoke(app, ["bench", "replay", "--help"], env={"COLUMNS": "400"})
    assert shown.exit_code == 0
    assert "park-on-pressure (full, parking only under pressure" in " ".join(shown.output.split())
