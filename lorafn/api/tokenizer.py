"""A model directory's tokenizer through the `tokenizers` library alone (no transformers, no torch).

The one reader of `tokenizer.json` + `tokenizer_config.json`, for the gateway (which adds chat templates
on top, `lorafn.gateway.tokenizer`) and the worker (`TextTokenizer`: encode, decode, EOS). transformers'
AutoTokenizer builds the same fast tokenizer from the same files, but importing and constructing it
cost a worker 2.9 s at start (issue 11); this costs milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


def read_tokenizer(model_dir: str | Path, who: str = "lorafn") -> tuple[Tokenizer, dict[str, Any]]:
    """`tokenizer.json` as a `tokenizers.Tokenizer`, and `tokenizer_config.json` ({} when absent).

    `who` names the reader in the error of a missing tokenizer.json."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the {who} needs the backbone's tokenizer.json")
    config: dict[str, Any] = {}
    if (model_dir / "tokenizer_config.json").is_file():
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    return Tokenizer.from_file(str(path)), config


def token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


def _clean_up_tokenization(text: str) -> str:
    # transformers' `clean_up_tokenization`, for configs that ask for it (WordPiece-era models)
    for before, after in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
        (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(before, after)
    return text


class TextTokenizer:
    """What the engine needs of a tokenizer, with transformers' results for the same files: `encode`
    (special tokens added by tokenizer.json's post-processor), `decode` (optionally skipping special
    tokens; the config's clean-up of spaces, which transformers skips for BPE models), `eos_token_id`."""

    def __init__(self, model_dir: str | Path) -> None:
        self.tokenizer, config = read_tokenizer(model_dir, who="worker")
        eos = token_text(config.get("eos_token"))
        self.eos_token_id: int | None = self.tokenizer.token_to_id(eos) if eos else None
        is_bpe = type(self.tokenizer.model).__name__ == "BPE"
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            not is_bpe
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_spaces else text
