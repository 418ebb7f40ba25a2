"""Shared helpers of the engine tests: tiny models built with transformers, real PEFT adapters, and the
transformers + peft greedy reference (unmerged LoRA)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def write_hf_model(
    out: Path,
    tokenizer_dir: Path,
    model_type: str = "llama",
    *,
    seed: int = 0,
    std: float = 0.1,
    bias_std: float = 0.0,
    **overrides,
) -> Path:
    """A tiny random model of `model_type`, saved by transformers itself (config.json + safetensors).

    std 0.1 (not the usual 0.02) keeps greedy outputs varied, so token equality means something.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=std,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if bias_std:  # transformers initializes biases to zero: make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, bias_std)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(tokenizer_dir, out)
    return out


def write_peft_adapter(
    base_dir: Path,
    out: Path,
    *,
    r: int,
    lora_alpha: float,
    target_modules,
    use_rslora: bool = False,
    seed: int = 0,
    b_std: float = 0.2,
    **extra,
) -> Path:
    """A real PEFT adapter (get_peft_model + save_pretrained) with random non-zero A and B, both from `seed`.

    A is drawn as PEFT draws it (kaiming-uniform: U(-1/sqrt(in), 1/sqrt(in))) but from the seeded generator:
    PEFT's own draw used the global RNG, whose state depends on what ran before in the process, so the
    same call wrote different adapters from run to run (a test that needed a non-blank answer failed
    once in CI)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=target_modules,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        **extra,
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                bound = p.shape[1] ** -0.5
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    model.save_pretrained(out)
    return out


def hf_greedy(
    base_dir: Path,
    adapter_dir: Path | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    margins: list | None = None,
) -> list[list[int]]:
    """Greedy tokens of transformers (+ PeftModel, unmerged), one prompt at a time (no padding).

    margins: if a list is given, one list per prompt of the top-1 minus top-2 logit at each step.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).to(device).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:  # plain greedy loop with transformers' KV cache: no logits processors
            out = model(input_ids=torch.tensor([ids], device=device), use_cache=True)
            tokens: list[int] = []
            gaps: list[float] = []
            while True:
                top = out.logits[0, -1].float().topk(2)
                tokens.append(int(top.indices[0]))
                gaps.append(float(top.values[0] - top.values[1]))
                if len(tokens) == max_new_tokens:
                    break
                out = model(
                    input_ids=torch.tensor([[tokens[-1]]], device=device),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
            outs.append(tokens)
            if margins is not None:
                margins.append(gaps)
    del model
    return outs


def mixed_prompts(seed: int = 0, lengths=(1, 5, 17, 33, 9, 64), vocab: int = 1000) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def engine_greedy(engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from lorafn.runtime import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]
