"""Shared helpers of the engine tests: tiny models built with transformers, real PEFT adapters, and the
transformers + peft greedy reference (unmerged LoRA)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

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


# step call -> the requests added before it: (request id, prompt ids, SamplingParams)
Arrivals = dict[int, list[tuple[str, list[int], Any]]]


def drive(eng, arrivals: Arrivals, abort_at: dict[int, str] | None = None) -> dict[str, dict]:
    """Add each request at its step call (0, 1, ...), abort the named ones at theirs, step until done.
    Returns per request: its output's tokens, text and finish reason, and its deltas' tokens and text."""
    from lorafn.runtime.engine import PENDING_TOKEN

    got: dict[str, dict] = {}
    abort_at = abort_at or {}
    outputs = {}
    for call in range(2000):
        for rid, prompt, params in arrivals.get(call, []):
            eng.add_request(prompt, params, request_id=rid)
            outputs[rid] = eng.get_output(rid)
            got[rid] = {"delta_tokens": [], "delta_text": "", "finals": 0}
        if call in abort_at:
            assert eng.abort(abort_at[call])
        if call > max(arrivals) and not eng.has_unfinished():
            break
        for d in eng.step():
            g = got[d.request_id]
            assert g["finals"] == 0, f"{d.request_id}: a delta after its final one"
            g["delta_tokens"] += d.token_ids
            g["delta_text"] += d.text
            g["finals"] += d.finished
    assert not eng.has_unfinished()
    assert eng.scheduler.block_manager.num_used_blocks == 0, "a KV block is still held"
    for rid, out in outputs.items():
        g = got[rid]
        g.update(tokens=out.token_ids, text=out.text, reason=out.finish_reason)
        assert PENDING_TOKEN not in out.token_ids, f"{rid}: a placeholder token in its output"
        if out.finish_reason != "abort":  # an aborted request's final delta is the abort's own
            assert g["finals"] == 1 and g["delta_tokens"] == out.token_ids and g["delta_text"] == out.text
    return got


def mixed_arrivals(prompts: list[list[int]], stop_token: int, stop: str | None) -> Arrivals:
    """A trace of 9 (10 with ``stop``) requests over the first step calls, of 9 prompts: greedy, seeded and
    filtered sampling, a stop token, a stop string (the third prompt's, when given), EOS, max_tokens 1 and 2,
    requests joining a running batch."""
    from lorafn.runtime import SamplingParams

    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    arrivals: Arrivals = {
        0: [
            ("greedy", prompts[0], greedy),
            ("seeded", prompts[1], SamplingParams(max_tokens=9, temperature=1.0, seed=5, ignore_eos=True)),
            (
                "stop-token",
                prompts[2],
                SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_token]),
            ),
        ],
        1: [("one-token", prompts[3], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))],
        2: [
            (
                "filtered",
                prompts[4],
                SamplingParams(max_tokens=8, temperature=0.8, top_k=40, top_p=0.9, seed=3, ignore_eos=True),
            ),
            ("eos", prompts[5], SamplingParams(max_tokens=14, temperature=0.0)),
        ],
        4: [
            ("late", prompts[6], greedy),
            ("two-tokens", prompts[7], SamplingParams(max_tokens=2, temperature=0.0)),
        ],
        5: [("long", prompts[8], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))],
    }
    if stop is not None:
        arrivals[3] = [
            ("stop-string", prompts[2], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]))
        ]
    return arrivals
