"""A real byte-level BPE tokenizer for random models, padded to any vocabulary size.

The merges are trained (with the `tokenizers` library) on a small fixed text shipped in
`_corpus.py`; the vocabulary is then laid out so that the special tokens sit at the ids the real
model uses (Llama-3: 128000…; Llama-2: 0, 1, 2) and every other id holds a learned token or a filler
(`<|filler_N|>`, a plain token no merge produces). Any text round-trips through it (byte-level), and
transformers' AutoTokenizer loads it with its chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

# Learned tokens beyond the 256 bytes: enough to make text a few times shorter than bytes, small
# enough to train in well under a second.
MAX_LEARNED_TOKENS = 2048


def build_tokenizer(*, vocab_size: int, specials: dict[int, str], bos_token: str):
    """A `tokenizers.Tokenizer` with exactly `vocab_size` ids; `specials` maps id → special token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from lorafn.models._corpus import corpus_lines

    num_regular = vocab_size - len(specials)
    if num_regular < 256:
        raise ValueError(
            f"vocab_size {vocab_size} leaves {num_regular} regular ids; need at least 256 (bytes)"
        )
    learn = min(num_regular, 256 + MAX_LEARNED_TOKENS)

    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=learn,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    trainer_tok.train_from_iterator(corpus_lines(), trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    learned = sorted(trained["vocab"].items(), key=lambda kv: kv[1])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]

    vocab: dict[str, int] = {}
    free_ids = (i for i in range(vocab_size) if i not in specials)
    for token, _ in learned:
        vocab[token] = next(free_ids)
    for i in free_ids:
        vocab[f"<|filler_{i}|>"] = i
    for i, token in specials.items():
        vocab[token] = i

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    bos_id = vocab[bos_token]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos_token}:0 $A:0",
        pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos_id)],
    )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for _, t in sorted(specials.items())]
    )
    for i, t in specials.items():
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t} landed at id {tok.token_to_id(t)}, expected {i}")
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, expected {vocab_size}")
    return tok


def write_tokenizer(
    out: Path,
    *,
    vocab_size: int,
    specials: dict[int, str],
    bos_token: str,
    eos_token: str,
    chat_template: str,
    model_max_length: int,
) -> None:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json in `out` (deterministic bytes)."""
    tok = build_tokenizer(vocab_size=vocab_size, specials=specials, bos_token=bos_token)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in sorted(specials.items())
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": eos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "model_input_names": ["input_ids", "attention_mask"],
        "added_tokens_decoder": added,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": bos_token, "eos_token": eos_token}, indent=2) + "\n"
    )
