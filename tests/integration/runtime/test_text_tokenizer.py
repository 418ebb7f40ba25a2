"""The worker's tokenizer (`tokenizers` alone) gives transformers' AutoTokenizer's ids, text and EOS."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafn.api.tokenizer import TextTokenizer

TEXTS = [
    "Hello there!",
    "The capital of France is",
    " leading space. Isn't it 're ?",
    "def f(x):\n    return x * 2\n",
    "日本語のテキスト 🎉",
    "<|im_start|>user hi<|im_end|>",
    "",
]


def _same_as_transformers(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    reference, ours = AutoTokenizer.from_pretrained(model_dir), TextTokenizer(model_dir)
    assert ours.eos_token_id == reference.eos_token_id is not None
    for text in TEXTS:
        ids = reference.encode(text)
        assert ours.encode(text) == ids, text
        generated = [*ids, 0, 1, 2, 3, 50, 100, reference.eos_token_id]
        for skip in (True, False):
            assert ours.decode(generated, skip_special_tokens=skip) == reference.decode(
                generated, skip_special_tokens=skip
            ), (text, skip)


def test_tiny_model(tiny_model_dir: Path) -> None:
    _same_as_transformers(tiny_model_dir)


@pytest.mark.slow
def test_smollm2(smollm2_dir: Path) -> None:
    _same_as_transformers(smollm2_dir)


def test_a_directory_without_tokenizer_json_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found: the worker needs"):
        TextTokenizer(tmp_path)
