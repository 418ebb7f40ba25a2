"""Is this PEFT directory a LoRA adapter the runtime can load for this backbone?

Shared by the operator (condition `AdapterReady`) and `lorafn apply` (local mode), so both refuse
the same adapters with the same reasons.

Reads only `adapter_config.json`, the JSON header of `adapter_model.safetensors` and the backbone's
`config.json`, without torch: a safetensors file starts with an 8-byte little-endian length N and N
bytes of JSON mapping each tensor name to its dtype, shape and byte range. So the operator can refuse
a wrong adapter (DoRA, `modules_to_save`, embedding LoRA, shapes of another model) before any GPU
worker tries to load it, with a reason a user can act on.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafn.api.uris import parse_uri

# Condition reasons (AdapterReady=False). Stable strings: users and tests match on them.
REASON_UNSUPPORTED_SCHEME = "UnsupportedURIScheme"
REASON_INVALID_URI = "InvalidURI"
REASON_CLAIM_NOT_MOUNTED = "ClaimNotMounted"
REASON_NOT_FOUND = "AdapterNotFound"
REASON_CONFIG_INVALID = "AdapterConfigInvalid"
REASON_NOT_LORA = "NotLoRA"
REASON_UNSUPPORTED_FEATURE = "UnsupportedAdapterFeature"
REASON_INVALID_RANK = "InvalidRank"
REASON_WEIGHTS_MISSING = "AdapterWeightsMissing"
REASON_WEIGHTS_INVALID = "AdapterWeightsInvalid"
REASON_TARGET_MISMATCH = "TargetModuleMismatch"
REASON_SHAPE_MISMATCH = "ShapeMismatch"
REASON_BACKBONE_CONFIG = "BackboneConfigNotFound"
REASON_UNSUPPORTED_ARCH = "UnsupportedArchitecture"

# Decoder architectures whose linear layers carry these names (Llama and its close relatives).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LINEAR_MODULES = ATTENTION_MODULES + MLP_MODULES

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
_MAX_HEADER_BYTES = 100 * 1024 * 1024
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may follow lora_A).
_TENSOR_RE = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


class AdapterProblem(ValueError):
    """The adapter cannot be used: `reason` is a CamelCase condition reason, the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class AdapterInfo:
    """What the operator learned about a valid adapter (the adapter *shape* of DESIGN §2 and more)."""

    path: str
    rank: int
    alpha: float
    target_modules: list[str]
    dtype: str
    num_tensors: int
    use_rslora: bool = False
    layers: list[int] = field(default_factory=list)

    def to_status(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "targetModules": list(self.target_modules),
            "dtype": self.dtype,
            "numTensors": self.num_tensors,
            "path": self.path,
        }


def resolve_local_path(uri: str, pvc_root: str) -> Path:
    """Where the operator sees `uri`: file:// as is, pvc://claim/path under `pvc_root`/claim.

    A `pvc://` claim must be mounted into the operator pod (chart value `operator.pvcClaims`); an
    unmounted claim is `ClaimNotMounted`, not `AdapterNotFound`, so the fix is obvious.
    """
    try:
        parsed = parse_uri(uri)
    except ValueError as exc:
        reason = REASON_UNSUPPORTED_SCHEME if "not supported" in str(exc) else REASON_INVALID_URI
        raise AdapterProblem(reason, str(exc)) from None
    local = Path(parsed.local_path(pvc_root))
    if parsed.scheme == "pvc" and not (Path(pvc_root) / str(parsed.claim)).is_dir():
        raise AdapterProblem(
            REASON_CLAIM_NOT_MOUNTED,
            f"PersistentVolumeClaim {parsed.claim!r} of {uri} is not mounted into the operator at "
            f"{pvc_root}/{parsed.claim}; add it to the chart value operator.pvcClaims",
        )
    return local


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: {name: {dtype, shape, data_offsets}, __metadata__?}."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        prefix = fh.read(8)
        if len(prefix) != 8:
            raise AdapterProblem(REASON_WEIGHTS_INVALID, f"{path} is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER_BYTES or length + 8 > size:
            raise AdapterProblem(
                REASON_WEIGHTS_INVALID,
                f"{path}: header length {length} does not fit the file ({size} bytes)",
            )
        raw = fh.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterProblem(REASON_WEIGHTS_INVALID, f"{path}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise AdapterProblem(REASON_WEIGHTS_INVALID, f"{path}: header is not a JSON object")
    data_size = size - 8 - length
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        ok = (
            isinstance(meta, dict)
            and isinstance(meta.get("shape"), list)
            and isinstance(meta.get("data_offsets"), list)
            and len(meta["data_offsets"]) == 2
            and 0 <= meta["data_offsets"][0] <= meta["data_offsets"][1] <= data_size
        )
        if not ok:
            raise AdapterProblem(REASON_WEIGHTS_INVALID, f"{path}: tensor {name!r} has a bad entry {meta!r}")
    return header


def _read_json(path: Path, reason: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterProblem(reason, f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterProblem(reason, f"{what} {path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise AdapterProblem(reason, f"{what} {path} is not a JSON object")
    return data


def linear_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-able linear layer of a Llama-like backbone config."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise AdapterProblem(
            REASON_UNSUPPORTED_ARCH,
            f"backbone model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
        )
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterProblem(
            REASON_BACKBONE_CONFIG, f"backbone config.json lacks a dimension: {exc}"
        ) from None
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _targeted_modules(target: Any, num_layers: int) -> list[str]:
    """The module names (q_proj, ...) that `target_modules` selects, or AdapterProblem."""
    if target == "all-linear":
        return list(LINEAR_MODULES)
    if isinstance(target, str):
        # PEFT reads a string as a regular expression over the full module names.
        try:
            pattern = re.compile(target)
        except re.error as exc:
            raise AdapterProblem(REASON_CONFIG_INVALID, f"target_modules regex {target!r}: {exc}") from None
        names = {
            module
            for layer in range(num_layers)
            for module in LINEAR_MODULES
            for full in [
                f"model.layers.{layer}.{'self_attn' if module in ATTENTION_MODULES else 'mlp'}.{module}"
            ]
            if pattern.fullmatch(full)
        }
        if not names:
            raise AdapterProblem(
                REASON_TARGET_MISMATCH, f"target_modules {target!r} matches no linear layer of the backbone"
            )
        return sorted(names, key=LINEAR_MODULES.index)
    if not isinstance(target, list) or not target or not all(isinstance(t, str) for t in target):
        raise AdapterProblem(
            REASON_CONFIG_INVALID,
            f"target_modules must be a non-empty list of names or a string, got {target!r}",
        )
    unknown = [t for t in target if t.rsplit(".", 1)[-1] not in LINEAR_MODULES]
    if unknown:
        raise AdapterProblem(
            REASON_TARGET_MISMATCH,
            f"target_modules {unknown} are not linear layers of the backbone (supported: "
            f"{', '.join(LINEAR_MODULES)}; embedding and lm_head LoRA are not supported)",
        )
    return sorted({t.rsplit(".", 1)[-1] for t in target}, key=LINEAR_MODULES.index)


def validate_adapter(adapter_dir: Path, backbone_dir: Path) -> AdapterInfo:
    """Check a PEFT LoRA directory against the backbone's config.json; AdapterProblem when not usable."""
    if not adapter_dir.is_dir():
        raise AdapterProblem(REASON_NOT_FOUND, f"adapter directory {adapter_dir} does not exist")
    config = _read_json(adapter_dir / "adapter_config.json", REASON_CONFIG_INVALID, "adapter config")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterProblem(REASON_NOT_LORA, f"adapter_config.json peft_type is {peft_type!r}, not 'LORA'")
    refused = {
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "bias": config.get("bias", "none") not in (None, "none"),
    }
    bad = [name for name, is_set in refused.items() if is_set]
    if bad:
        raise AdapterProblem(
            REASON_UNSUPPORTED_FEATURE,
            f"adapter_config.json sets {', '.join(bad)}: not supported (plain LoRA only: rank, lora_alpha, "
            "use_rslora, target_modules, bias 'none')",
        )
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise AdapterProblem(
            REASON_INVALID_RANK, f"adapter_config.json r must be a positive integer, got {rank!r}"
        )
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterProblem(
            REASON_CONFIG_INVALID, f"adapter_config.json lora_alpha {alpha!r} is not a number"
        )

    backbone_config = _read_json(backbone_dir / "config.json", REASON_BACKBONE_CONFIG, "backbone config")
    shapes = linear_shapes(backbone_config)
    num_layers = int(backbone_config.get("num_hidden_layers", 0))
    modules = _targeted_modules(config.get("target_modules"), num_layers)

    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        raise AdapterProblem(
            REASON_WEIGHTS_MISSING, f"{weights} does not exist (only safetensors are loaded)"
        )
    header = read_safetensors_header(weights)

    seen: dict[tuple[int, str], dict[str, list[int]]] = {}
    dtypes: set[str] = set()
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        match = _TENSOR_RE.match(name)
        if match is None:
            raise AdapterProblem(
                REASON_UNSUPPORTED_FEATURE,
                f"tensor {name!r} is not a LoRA A/B weight of a decoder linear layer",
            )
        layer, _block, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in modules:
            raise AdapterProblem(
                REASON_TARGET_MISMATCH,
                f"tensor {name!r} targets {module}, which target_modules does not list",
            )
        if layer >= num_layers:
            raise AdapterProblem(
                REASON_SHAPE_MISMATCH,
                f"tensor {name!r} is for layer {layer}; the backbone has {num_layers} layers",
            )
        dtypes.add(_SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"]))
        seen.setdefault((layer, module), {})[which] = meta["shape"]
    if not seen:
        raise AdapterProblem(REASON_WEIGHTS_INVALID, f"{weights} holds no LoRA tensors")
    for (layer, module), pair in sorted(seen.items()):
        in_features, out_features = shapes[module]
        want = {"A": [rank, in_features], "B": [out_features, rank]}
        for which in ("A", "B"):
            if which not in pair:
                raise AdapterProblem(
                    REASON_WEIGHTS_INVALID, f"layer {layer} {module}: lora_{which} is missing"
                )
            if pair[which] != want[which]:
                raise AdapterProblem(
                    REASON_SHAPE_MISMATCH,
                    f"layer {layer} {module}: lora_{which} has shape {pair[which]}, the backbone needs "
                    f"{want[which]} (rank {rank}, in {in_features}, out {out_features})",
                )
    if len(dtypes) != 1:
        raise AdapterProblem(REASON_WEIGHTS_INVALID, f"{weights} mixes dtypes {sorted(dtypes)}")
    return AdapterInfo(
        path=str(adapter_dir),
        rank=rank,
        alpha=float(alpha),
        target_modules=modules,
        dtype=dtypes.pop(),
        num_tensors=2 * len(seen),
        use_rslora=bool(config.get("use_rslora")),
        layers=sorted({layer for layer, _ in seen}),
    )


def parse_api_keys(text: str) -> list[str]:
    """API keys in a Secret value: one per line (or comma-separated); blanks and # comments ignored."""
    keys = []
    for line in text.replace(",", "\n").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys
