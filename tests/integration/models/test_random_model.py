"""Random models written for real: transformers loads them, same seed gives same bytes, RAM stays bounded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lorafn.models._outdir import AssetError
from lorafn.models.random_model import write_random_model


def test_tiny_model_dir_is_a_standard_hf_directory(tiny_model_dir: Path) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    index = json.loads((tiny_model_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) <= names
    size = sum((tiny_model_dir / f).stat().st_size for f in set(index["weight_map"].values()))
    assert 1 << 20 < size < 10 << 20


def test_transformers_loads_tiny_and_generates(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (4, 2, 4)
    assert len(tok) == cfg.vocab_size == 1024
    assert tok.bos_token_id == cfg.bos_token_id

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user")
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8 or out[0, -1].item() in model.generation_config.eos_token_id
    assert tok.decode(tok("Héllo wörld 123")["input_ids"], skip_special_tokens=True) == "Héllo wörld 123"


def test_bfloat16_activations_stay_finite(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    d = write_random_model("tiny", tmp_path / "bf16", seed=3, dtype="bfloat16", progress=False)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    logits = model(torch.arange(1, 200)[None]).logits
    assert torch.isfinite(logits).all()


def test_same_seed_same_bytes_whatever_the_shard_size(tmp_path: Path, tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    again = write_random_model("tiny", tmp_path / "again", seed=0, progress=False)
    for p in tiny_model_dir.iterdir():
        assert p.read_bytes() == (again / p.name).read_bytes(), p.name

    sharded = write_random_model(
        "tiny", tmp_path / "sharded", seed=0, max_shard_bytes=500_000, progress=False
    )
    assert len(list(sharded.glob("model-*.safetensors"))) > 4

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for f in sorted(d.glob("model-*.safetensors")):
            out.update(load_file(f))
        return out

    a, b = tensors(tiny_model_dir), tensors(sharded)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)

    other = tensors(write_random_model("tiny", tmp_path / "seed1", seed=1, progress=False))
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    w = a["model.layers.0.mlp.up_proj.weight"]
    assert abs(w.std().item() - 0.02) < 0.002
    assert torch.equal(a["model.norm.weight"], torch.ones_like(a["model.norm.weight"]))


def test_writing_is_bounded_in_memory(tmp_path: Path) -> None:
    """A scaled-down model (~310 MB in float32, 40 MB shards) written with a small RSS increase.

    Run in a fresh process so that the peak RSS (ru_maxrss) belongs to this write alone.
    """
    script = textwrap.dedent(
        f"""
        import resource, dataclasses
        import torch
        from pathlib import Path
        from lorafn.models import random_model as rm
        torch.randn(10)  # warm the allocator and the RNG code
        rm.PRESETS["scaled"] = dataclasses.replace(
            rm.PRESETS["tiny"], name="scaled", hidden_size=1024, intermediate_size=2816,
            num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4, vocab_size=16384)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rm.write_random_model("scaled", Path({str(tmp_path / "scaled")!r}), seed=0,
                              max_shard_bytes=40_000_000, progress=False)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) * 1024)
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    grown = int(res.stdout.strip().splitlines()[-1])
    total = sum(p.stat().st_size for p in (tmp_path / "scaled").glob("model-*.safetensors"))
    assert total > 300_000_000
    assert len(list((tmp_path / "scaled").glob("model-*.safetensors"))) >= 7
    # One 16 MiB float32 chunk is live at a time, plus the tokenizer's training and imports (~70 MB
    # measured): far below one copy of the model, let alone two.
    assert grown < 120 * 2**20 < total / 2, (grown, total)


def test_bad_out_is_refused(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(AssetError, match="is a file"):
        write_random_model("tiny", a_file, seed=0, progress=False)
    unrelated = tmp_path / "unrelated"
    (unrelated / "src").mkdir(parents=True)
    with pytest.raises(AssetError, match="non-empty directory"):
        write_random_model("tiny", unrelated, seed=0, progress=False)
