"""The example adapters (examples/adapters/): real PEFT LoRA adapters for SmolLM2-135M-Instruct that
load with peft and change its greedy answers visibly: `french` answers in French, `gsm8k-format` ends
its answers to math word problems with `#### <number>`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
ADAPTERS = REPO / "examples" / "adapters"
DATA = REPO / "examples" / "data"

FRENCH_WORDS = {
    "le",
    "la",
    "les",
    "est",
    "de",
    "des",
    "du",
    "et",
    "un",
    "une",
    "en",
    "à",
    "pour",
    "qui",
    "que",
    "dans",
    "sont",
    "il",
    "elle",
    "je",
    "vous",
    "pas",
    "au",
    "aux",
    "sur",
    "avec",
}
ENGLISH_WORDS = {
    "the",
    "is",
    "are",
    "and",
    "of",
    "to",
    "in",
    "a",
    "it",
    "that",
    "with",
    "for",
    "you",
    "i",
    "on",
    "this",
    "be",
    "as",
    "was",
    "have",
}


def _words(text: str) -> list[str]:
    return re.findall(r"[a-zàâçéèêëîïôûùüÿœ']+", text.lower())


def looks_french(text: str) -> bool:
    words = _words(text)
    fr = sum(w in FRENCH_WORDS for w in words)
    en = sum(w in ENGLISH_WORDS for w in words)
    return fr >= 2 and fr > 2 * en


def _held_out(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def base(smollm2_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return model, tok


def greedy(model, tok, prompt: str, max_new_tokens: int) -> str:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def with_adapter(base_model, name: str):
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model, ADAPTERS / name)


def test_language_check_itself() -> None:
    assert looks_french("La capitale de la Suisse est Berne.")
    assert not looks_french("The capital of Switzerland is Bern.")


@pytest.mark.parametrize("name", ["french", "gsm8k-format"])
def test_adapter_is_a_small_plain_peft_lora(name: str) -> None:
    d = ADAPTERS / name
    config = json.loads((d / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert config["bias"] == "none"
    assert not config.get("modules_to_save")
    assert not config.get("use_dora")
    assert (d / "adapter_model.safetensors").stat().st_size < 20 * 2**20


def test_the_two_adapters_differ_in_rank_and_targets() -> None:
    a = json.loads((ADAPTERS / "french" / "adapter_config.json").read_text())
    b = json.loads((ADAPTERS / "gsm8k-format" / "adapter_config.json").read_text())
    assert (a["r"], b["r"]) == (8, 16)
    assert sorted(a["target_modules"]) == ["q_proj", "v_proj"]
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= set(
        b["target_modules"]
    )


def test_french_adapter_answers_in_french(base) -> None:
    model, tok = base
    prompts = [r["prompt"] for r in _held_out("french_heldout.jsonl")][:3]
    before = [greedy(model, tok, p, 40) for p in prompts]
    tuned = with_adapter(model, "french")
    try:
        after = [greedy(tuned, tok, p, 40) for p in prompts]
    finally:
        tuned.unload()  # give the base model back without the LoRA layers
    assert before != after
    assert not any(looks_french(b) for b in before), before
    assert all(looks_french(a) for a in after), after


def test_gsm8k_adapter_ends_with_the_answer_line(base) -> None:
    model, tok = base
    # On all 20 held-out problems 19 adapter answers end with the line and no base answer does
    # (`train_adapters.py --eval`); these two are among them (greedy decoding is deterministic).
    held = _held_out("gsm8k_heldout.jsonl")[1:3]
    before = [greedy(model, tok, r["prompt"], 200) for r in held]
    tuned = with_adapter(model, "gsm8k-format")
    try:
        after = [greedy(tuned, tok, r["prompt"], 200) for r in held]
    finally:
        tuned.unload()
    assert before != after
    final = re.compile(r"#### *-?[\d,.]+\s*$")
    assert not any(final.search(b) for b in before), before
    for a in after:
        assert final.search(a), a
