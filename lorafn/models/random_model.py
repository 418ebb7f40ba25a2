"""Random Llama models of real shapes: a standard Hugging Face model directory with random weights.

`write_random_model("llama-3-8b", out, seed=0)` writes what `Meta-Llama-3-8B` has on disk, with the
same config numbers and tensor shapes, but random weights and a small byte-level BPE tokenizer padded
to the real vocabulary size (with the real special-token ids). Tests use the `tiny` preset; GPU
benchmarks use the big ones so that they measure real shapes.

Memory stays bounded whatever the model size: each tensor is generated in fixed-size chunks that are
written straight into the shard file (our own streaming safetensors writer), so writing a 16 GB model
needs about one chunk of RAM, not the model twice over.

Weights depend only on (seed, tensor name, shape, dtype), never on the shard size: the same seed gives
identical bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from lorafn.models._outdir import AssetError, prepare_out_dir

DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
_SAFETENSORS_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
DEFAULT_MAX_SHARD_BYTES = 2 * 10**9
# Elements generated at once: bounds RAM (and fixes the random stream, so do not change it lightly:
# it is part of what "same seed, same bytes" means).
_CHUNK_ELEMENTS = 1 << 22
INIT_STD = 0.02

_LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = none %}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token }}[INST] "
    "{% if loop.first and system %}<<SYS>>\n{{ system }}\n<</SYS>>\n\n{% endif %}"
    "{{ message['content'] | trim }} [/INST]"
    "{% elif message['role'] == 'assistant' %} {{ message['content'] | trim }} {{ eos_token }}"
    "{% endif %}{% endfor %}"
)


def _llama3_specials(first_id: int, count: int) -> dict[int, str]:
    """Llama-3's special-token layout: `count` tokens from `first_id` (128000…128255 in the real one)."""
    named = {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        9: "<|eot_id|>",
    }
    out, reserved = {}, 0
    for k in range(count):
        if k in named:
            out[first_id + k] = named[k]
        else:
            out[first_id + k] = f"<|reserved_special_token_{reserved}|>"
            reserved += 1
    return out


@dataclass(frozen=True)
class Preset:
    """One model shape. The numbers of the real presets are those of the published config.json."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token: str
    eos_token: str
    chat_template: str
    specials: dict[int, str] = field(default_factory=dict)
    generation_eos: tuple[str, ...] = ()
    tie_word_embeddings: bool = False
    source: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def token_id(self, token: str) -> int:
        return next(i for i, t in self.specials.items() if t == token)


PRESETS: dict[str, Preset] = {
    # A few-MB Llama for tests: GQA (4 query heads share 2 KV heads), RoPE, 4 layers.
    "tiny": Preset(
        name="tiny",
        hidden_size=128,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        chat_template=_LLAMA3_CHAT_TEMPLATE,
        specials=_llama3_specials(1024 - 16, 16),
        generation_eos=("<|end_of_text|>", "<|eot_id|>"),
        source="lorafn test preset (Llama-3 layout, scaled down)",
    ),
    # meta-llama/Llama-2-7b-hf config.json
    "llama-2-7b": Preset(
        name="llama-2-7b",
        hidden_size=4096,
        intermediate_size=11008,
        num_attention_heads=32,
        num_key_value_heads=32,
        num_hidden_layers=32,
        vocab_size=32000,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        bos_token="<s>",
        eos_token="</s>",
        chat_template=_LLAMA2_CHAT_TEMPLATE,
        specials={0: "<unk>", 1: "<s>", 2: "</s>"},
        generation_eos=("</s>",),
        source="meta-llama/Llama-2-7b-hf",
    ),
    # meta-llama/Meta-Llama-3-8B config.json
    "llama-3-8b": Preset(
        name="llama-3-8b",
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        chat_template=_LLAMA3_CHAT_TEMPLATE,
        specials=_llama3_specials(128000, 256),
        generation_eos=("<|end_of_text|>", "<|eot_id|>"),
        source="meta-llama/Meta-Llama-3-8B",
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise AssetError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def config_dict(preset: Preset, dtype: str) -> dict:
    """The config.json of a LlamaForCausalLM with the preset's shape."""
    eos_ids = [preset.token_id(t) for t in preset.generation_eos] or [preset.token_id(preset.eos_token)]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "num_hidden_layers": preset.num_hidden_layers,
        "head_dim": preset.head_dim,
        "vocab_size": preset.vocab_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "rope_theta": preset.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": preset.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": INIT_STD,
        "pretraining_tp": 1,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": preset.token_id(preset.bos_token),
        "eos_token_id": eos_ids[0],
        "torch_dtype": dtype,
        "lorafn_random": {"preset": preset.name, "source": preset.source},
    }


def tensor_specs(preset: Preset) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight of a LlamaForCausalLM, in checkpoint order."""
    h, i, hd = preset.hidden_size, preset.intermediate_size, preset.head_dim
    q_out, kv_out = preset.num_attention_heads * hd, preset.num_key_value_heads * hd
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (preset.vocab_size, h))]
    for layer in range(preset.num_hidden_layers):
        p = f"model.layers.{layer}."
        specs += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q_out, h)),
            (p + "self_attn.k_proj.weight", (kv_out, h)),
            (p + "self_attn.v_proj.weight", (kv_out, h)),
            (p + "self_attn.o_proj.weight", (h, q_out)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    specs.append(("model.norm.weight", (h,)))
    if not preset.tie_word_embeddings:
        specs.append(("lm_head.weight", (preset.vocab_size, h)))
    return specs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_shards(
    specs: list[tuple[str, tuple[int, ...]]], itemsize: int, max_shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Split tensors, in order, into shards of at most `max_shard_bytes` (a larger tensor goes alone)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = _numel(shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"lorafn-random:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _write_tensor(f, name: str, shape: tuple[int, ...], dtype: str, seed: int, progress) -> None:
    """Generate one tensor chunk by chunk and append its raw little-endian bytes to `f`.

    Norm weights (1-D) are ones, as a trained model's start; matrices are N(0, INIT_STD).
    """
    import torch

    tdtype = getattr(torch, dtype)
    n = _numel(shape)
    if len(shape) == 1:
        data = torch.ones(n, dtype=tdtype)
        f.write(data.view(torch.uint8).numpy().tobytes())
        progress.update(data.numel() * data.element_size())
        return
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    for start in range(0, n, _CHUNK_ELEMENTS):
        count = min(_CHUNK_ELEMENTS, n - start)
        chunk = torch.randn(count, generator=gen, dtype=torch.float32).mul_(INIT_STD).to(tdtype)
        f.write(memoryview(chunk.view(torch.uint8).numpy()))
        progress.update(count * chunk.element_size())
        del chunk


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: str, seed: int, progress):
    """A safetensors file written tensor by tensor (header first: the offsets are known up front)."""
    itemsize = DTYPES[dtype]
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = _numel(shape) * itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path.with_suffix(path.suffix + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in tensors:
            _write_tensor(f, name, shape, dtype, seed, progress)
    tmp.replace(path)
    return offset


def write_random_model(
    preset: str,
    out: Path,
    seed: int,
    dtype: str = "float32",
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write a random LlamaForCausalLM of `preset`'s shape to `out`; returns `out`.

    The directory holds config.json, generation_config.json, model-0000k-of-0000n.safetensors with
    model.safetensors.index.json, and tokenizer.json + tokenizer_config.json (AutoTokenizer loads it;
    it has the preset's chat template and special-token ids).
    """
    from tqdm.auto import tqdm

    from lorafn.models.tokenizer import write_tokenizer

    p = get_preset(preset)
    if dtype not in DTYPES:
        raise AssetError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if max_shard_bytes <= 0:
        raise AssetError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    specs = tensor_specs(p)
    itemsize = DTYPES[dtype]
    total = sum(_numel(s) for _, s in specs) * itemsize
    out = prepare_out_dir(Path(out), required_bytes=total, overwrite=overwrite)

    shards = plan_shards(specs, itemsize, max_shard_bytes)
    weight_map: dict[str, str] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"random {preset}", disable=not progress) as bar:
        for k, tensors in enumerate(shards, start=1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            _write_shard(out / fname, tensors, dtype, seed, bar)
            weight_map.update({name: fname for name, _ in tensors})

    _dump_json(
        out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map}
    )
    config = config_dict(p, dtype)
    _dump_json(out / "config.json", config)
    gen_eos = [p.token_id(t) for t in p.generation_eos]
    _dump_json(
        out / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": gen_eos if len(gen_eos) > 1 else gen_eos[0],
            "do_sample": False,
        },
    )
    write_tokenizer(
        out,
        vocab_size=p.vocab_size,
        specials=p.specials,
        bos_token=p.bos_token,
        eos_token=p.eos_token,
        chat_template=p.chat_template,
        model_max_length=p.max_position_embeddings,
    )
    return out


def _dump_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
