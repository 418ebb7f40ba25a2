"""Is this PEFT directory a LoRA adapter the runtime can load for this backbone?

Shared by the operator (condition `AdapterReady`) and `lorafn apply` (local mode), so both refuse
the same adapters with the same reasons.

Reads only `adapter_config.json`, the JSON header of `adapter_model.safetensors` and the backbone's
`config.json`, without torch: a safetensors file starts with an 8-byte little-endian length N and N
bytes of JSON mapping each tensor name to its dtype, shape and byte range (read and checked by
lorafn.api.safetensors, the reader the backbone server and runtime use too). So the operator can refuse
a wrong adapter (DoRA, `modules_to_save`, embedding LoRA, shapes of another model) before any GPU
worker tries to load it, with a reason a user can act on.

`check_adapter_config` is the one config-level check: the runtime's loader (`lorafn.runtime.lora`)
calls it too, so the operator, `lorafn apply` and the worker refuse the same configs with the same
words, and `pattern_matches` is the one reading of PEFT's `rank_pattern` / `alpha_pattern` keys.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import regex

from lorafn.api.safetensors import DTYPE_NAMES, SafetensorsError, SafetensorsHeader, read_header
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

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may follow lora_A).
_TENSOR_RE = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


class AdapterProblem(ValueError):
    """The adapter cannot be used: `reason` is a CamelCase condition reason, the message says why."""

    def __init__(self, reason: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.field = field  # the adapter_config.json field at fault, where there is one


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
    # module -> its largest rank over the layers (differs from `rank` only under rank_pattern)
    ranks: dict[str, int] = field(default_factory=dict)

    @property
    def shape_key(self) -> str:
        """The adapter shape (docs/architecture.md): targets with their largest rank, in projection order.

        Equal to the runtime's `LoRAWeights.shape_key` for the same adapter; workers prepared for one
        shape share graphs and LoRA buffers."""
        return ",".join(f"{m}:{self.ranks[m]}" for m in LINEAR_MODULES if m in self.ranks)

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


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """The checked header of a safetensors file (lorafn.api.safetensors); a broken one is
    AdapterProblem(AdapterWeightsInvalid) naming the file."""
    try:
        return read_header(path)
    except SafetensorsError as exc:
        raise AdapterProblem(REASON_WEIGHTS_INVALID, str(exc)) from None


def _read_json(path: Path, reason: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterProblem(reason, f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterProblem(reason, f"{what} {path} is not readable JSON: {exc}") from None
    except RecursionError:  # thousands of nested [ or {: the parser's depth limit, not a traceback
        raise AdapterProblem(reason, f"{what} {path} is nested too deeply to be a config") from None
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


# adapter_config.json fields that unmerged LoRA on a Llama-family backbone cannot honour: any truthy
# value is refused (PEFT writes False, None or an empty container when the feature is off).
REFUSED_FIELDS: dict[str, str] = {
    "use_dora": "DoRA is not supported (only plain LoRA)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layout) is not supported by the Llama family",
    "lora_bias": "LoRA bias is not supported",
    "use_qalora": "QALoRA is not supported",
    "modules_to_save": "would replace backbone modules (full trained copies); not supported",
    "trainable_token_indices": "trainable token embeddings are not supported",
    "layer_replication": "layer replication is not supported",
    "target_parameters": "LoRA on parameters (not linear modules) is not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
}
_EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "embed", "word_embeddings")


@dataclass(frozen=True)
class CheckedConfig:
    """An adapter_config.json that `check_adapter_config` accepted, with its values typed."""

    rank: int
    alpha: float
    use_rslora: bool
    # q_proj, ... as the config selects them; None for a regex not yet matched against a backbone
    target_modules: list[str] | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    raw: dict[str, Any]

    def rank_of(self, module_name: str) -> int:
        """The rank PEFT gives `module_name` (model.layers.3.self_attn.o_proj): rank_pattern, else r."""
        return next((v for k, v in self.rank_pattern.items() if pattern_matches(k, module_name)), self.rank)

    def alpha_of(self, module_name: str) -> float:
        """The lora_alpha PEFT gives `module_name`: alpha_pattern, else lora_alpha."""
        return next((v for k, v in self.alpha_pattern.items() if pattern_matches(k, module_name)), self.alpha)


# The config's regexes (target_modules, rank_pattern/alpha_pattern keys) come from tenants, and the
# operator runs them: `(.*.*.*)*X` kept Python's backtracking `re` busy for minutes. They are matched with
# the `regex` engine under a time budget, and their length is capped (issue 15).
MAX_PATTERN_CHARS = 1024
PATTERN_BUDGET_S = 1.0


def _compile(pattern: str, field_name: str) -> regex.Pattern[str]:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise _config_problem(
            REASON_CONFIG_INVALID,
            field_name,
            f"regex of {len(pattern)} characters; at most {MAX_PATTERN_CHARS}",
        )
    try:
        return regex.compile(pattern, flags=regex.VERSION0)  # VERSION0: the syntax of Python's re
    except (regex.error, re.error, ValueError) as exc:
        raise _config_problem(REASON_CONFIG_INVALID, field_name, f"regex {pattern!r}: {exc}") from None


def _fullmatch(pattern: regex.Pattern[str], text: str, deadline: float, field_name: str) -> bool:
    """`pattern` matches all of `text`; AdapterProblem once the pattern has used its time budget."""
    try:
        return pattern.fullmatch(text, timeout=max(1e-3, deadline - time.monotonic())) is not None
    except TimeoutError:
        raise _config_problem(
            REASON_CONFIG_INVALID,
            field_name,
            f"regex {pattern.pattern[:80]!r} takes too long to match module names "
            f"(over {PATTERN_BUDGET_S:g} s; nested repetition such as (.*)*?)",
        ) from None


def _module_names(num_layers: int) -> list[str]:
    """The full names of the backbone's linear layers (model.layers.0.self_attn.q_proj, ...)."""
    return [
        f"model.layers.{layer}.{'self_attn' if module in ATTENTION_MODULES else 'mlp'}.{module}"
        for layer in range(num_layers)
        for module in LINEAR_MODULES
    ]


def pattern_matches(pattern_key: str, module_name: str) -> bool:
    """PEFT's rule for a rank_pattern / alpha_pattern key (peft.utils.other.get_pattern_key).

    The key is a regex that must match a dotted suffix of the module name: "o_proj" and
    "layers.0.self_attn.o_proj" both select model.layers.0.self_attn.o_proj. The first key that
    matches, in the config's order, wins. Bounded in time like every config regex (AdapterProblem).
    """
    pattern = _compile(rf"(.*\.)?({pattern_key})", "rank_pattern")
    return _fullmatch(pattern, module_name, time.monotonic() + PATTERN_BUDGET_S, "rank_pattern")


def _config_problem(reason: str, field_name: str, detail: str) -> AdapterProblem:
    return AdapterProblem(reason, f"adapter_config.json {field_name}: {detail}", field=field_name)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# lora_alpha scales every delta: NaN, inf or 1e308 turns the output into NaN (an empty answer)
_MAX_ALPHA = 1e6
_ALPHA_WANTED = f"a finite number with |lora_alpha| <= {_MAX_ALPHA:g}"


def _is_alpha(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value) and abs(value) <= _MAX_ALPHA


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def target_module_names(target: Any, num_layers: int | None = None) -> list[str] | None:
    """The module names (q_proj, ...) that `target_modules` selects, or AdapterProblem.

    A string other than "all-linear" is, as in PEFT, a regex over the full module names
    (model.layers.0.self_attn.q_proj): without `num_layers` it is only compiled (None is returned);
    with it, it must select at least one linear layer of the backbone.
    """
    field_name = "target_modules"
    if target == "all-linear":
        return list(LINEAR_MODULES)
    if isinstance(target, str):
        pattern = _compile(target, field_name)
        if num_layers is None:
            return None
        deadline = time.monotonic() + PATTERN_BUDGET_S
        names = {
            full.rsplit(".", 1)[-1]
            for full in _module_names(num_layers)
            if _fullmatch(pattern, full, deadline, field_name)
        }
        if not names:
            raise _config_problem(
                REASON_TARGET_MISMATCH, field_name, f"{target!r} matches no linear layer of the backbone"
            )
        return sorted(names, key=LINEAR_MODULES.index)
    if not isinstance(target, list) or not target or not all(isinstance(t, str) for t in target):
        raise _config_problem(
            REASON_CONFIG_INVALID,
            field_name,
            f"must be a non-empty list of names or a string, got {target!r}",
        )
    unknown = [t for t in target if t.rsplit(".", 1)[-1] not in LINEAR_MODULES]
    if unknown:
        embedding = [t for t in unknown if t.rsplit(".", 1)[-1] in _EMBEDDING_NAMES]
        raise _config_problem(
            REASON_TARGET_MISMATCH,
            field_name,
            f"{unknown} are not linear layers of the backbone (supported: {', '.join(LINEAR_MODULES)})"
            + ("; embedding and lm_head LoRA are not supported" if embedding else ""),
        )
    return sorted({t.rsplit(".", 1)[-1] for t in target}, key=LINEAR_MODULES.index)


def check_adapter_config(config: dict[str, Any], num_layers: int | None = None) -> CheckedConfig:
    """The one config-level check of a PEFT LoRA adapter_config.json (operator, apply, runtime).

    Raises AdapterProblem (a ValueError) whose message starts "adapter_config.json <field>:" and whose
    `field` is that field. `num_layers` (the backbone's) lets a regex target_modules be matched.
    """
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise _config_problem(REASON_NOT_LORA, "peft_type", f"{peft_type!r} is not supported; only 'LORA'")
    refused = [name for name in REFUSED_FIELDS if config.get(name)]
    if refused:
        raise AdapterProblem(
            REASON_UNSUPPORTED_FEATURE,
            "; ".join(f"adapter_config.json {name}: {REFUSED_FIELDS[name]}" for name in refused),
            field=refused[0],
        )
    bias = config.get("bias", "none")
    if bias != "none":
        raise _config_problem(REASON_UNSUPPORTED_FEATURE, "bias", f"{bias!r} is not supported; only 'none'")

    rank = config.get("r")
    if not _is_rank(rank):
        raise _config_problem(REASON_INVALID_RANK, "r", f"must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", rank)
    if not _is_alpha(alpha):
        raise _config_problem(REASON_CONFIG_INVALID, "lora_alpha", f"{alpha!r} is not {_ALPHA_WANTED}")
    patterns: dict[str, dict[str, Any]] = {}
    for name, valid, want in (
        ("rank_pattern", _is_rank, "a positive integer"),
        ("alpha_pattern", _is_alpha, _ALPHA_WANTED),
    ):
        pattern = config.get(name) or {}
        if not isinstance(pattern, dict):
            raise _config_problem(
                REASON_CONFIG_INVALID, name, f"must map module names to values, got {pattern!r}"
            )
        for key, value in pattern.items():
            if not isinstance(key, str):
                raise _config_problem(REASON_CONFIG_INVALID, name, f"key {key!r} is not a string")
            compiled = _compile(rf"(.*\.)?({key})", name)
            if num_layers is not None:  # it will be matched against every module: bound it now
                deadline = time.monotonic() + PATTERN_BUDGET_S
                for full in _module_names(num_layers):
                    _fullmatch(compiled, full, deadline, name)
            if not valid(value):
                reason = REASON_INVALID_RANK if name == "rank_pattern" else REASON_CONFIG_INVALID
                raise _config_problem(reason, name, f"{key!r}: {value!r} is not {want}")
        patterns[name] = pattern
    return CheckedConfig(
        rank=rank,
        alpha=float(alpha),
        use_rslora=bool(config.get("use_rslora")),
        target_modules=target_module_names(config.get("target_modules"), num_layers),
        rank_pattern={k: int(v) for k, v in patterns["rank_pattern"].items()},
        alpha_pattern={k: float(v) for k, v in patterns["alpha_pattern"].items()},
        raw=config,
    )


def foreign_tensor(name: str) -> tuple[str, str]:
    """(field, why) for a safetensors key that is not a LoRA A/B weight of a decoder linear layer."""
    if "lora_embedding" in name or any(f"{e}." in name for e in _EMBEDDING_NAMES):
        return "target_modules", f"tensor {name}: embedding/lm_head LoRA is not supported"
    if "lora_magnitude_vector" in name:
        return "use_dora", f"tensor {name}: DoRA is not supported"
    if name.endswith(".bias"):
        return "lora_bias", f"tensor {name}: LoRA bias is not supported"
    return (
        "adapter_model.safetensors",
        f"unexpected tensor {name}: not a LoRA A/B weight of a decoder linear layer",
    )


def validate_adapter(adapter_dir: Path, backbone_dir: Path) -> AdapterInfo:
    """Check a PEFT LoRA directory against the backbone's config.json; AdapterProblem when not usable."""
    if not adapter_dir.is_dir():
        raise AdapterProblem(REASON_NOT_FOUND, f"adapter directory {adapter_dir} does not exist")
    config = _read_json(adapter_dir / "adapter_config.json", REASON_CONFIG_INVALID, "adapter config")
    checked = check_adapter_config(config)

    backbone_config = _read_json(backbone_dir / "config.json", REASON_BACKBONE_CONFIG, "backbone config")
    shapes = linear_shapes(backbone_config)
    num_layers = int(backbone_config.get("num_hidden_layers", 0))
    modules = target_module_names(config["target_modules"], num_layers) or []

    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        raise AdapterProblem(
            REASON_WEIGHTS_MISSING, f"{weights} does not exist (only safetensors are loaded)"
        )
    header = read_safetensors_header(weights)

    seen: dict[tuple[int, str], dict[str, list[int]]] = {}
    dtypes: set[str] = set()
    for name, meta in header.tensors.items():
        match = _TENSOR_RE.match(name)
        if match is None:
            field_name, why = foreign_tensor(name)
            raise AdapterProblem(REASON_UNSUPPORTED_FEATURE, f"{field_name}: {why}", field=field_name)
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
        dtypes.add(DTYPE_NAMES[meta.dtype])
        seen.setdefault((layer, module), {})[which] = list(meta.shape)
    if not seen:
        raise AdapterProblem(REASON_WEIGHTS_INVALID, f"{weights} holds no LoRA tensors")
    ranks: dict[str, int] = {}
    for (layer, module), pair in sorted(seen.items()):
        in_features, out_features = shapes[module]
        block = "self_attn" if module in ATTENTION_MODULES else "mlp"
        rank = checked.rank_of(f"model.layers.{layer}.{block}.{module}")
        ranks[module] = max(ranks.get(module, 0), rank)
        want = {"A": [rank, in_features], "B": [out_features, rank]}
        for which in ("A", "B"):
            if which not in pair:
                raise AdapterProblem(
                    REASON_WEIGHTS_INVALID, f"layer {layer} {module}: lora_{which} is missing"
                )
            if pair[which] != want[which]:
                got, need = pair[which], want[which]
                rank_axis = 0 if which == "A" else 1  # A is [r, in], B is [out, r]
                base_axis = 1 - rank_axis
                if len(got) == 2 and got[base_axis] == need[base_axis] and got[rank_axis] != rank:
                    # the backbone's side fits: adapter_config.json disagrees with the adapter's own tensors
                    raise AdapterProblem(
                        REASON_INVALID_RANK,
                        f"layer {layer} {module}: adapter_config.json gives rank {rank} (r, rank_pattern), "
                        f"but lora_{which} has rank {got[rank_axis]} (shape {got})",
                        field="r",
                    )
                raise AdapterProblem(
                    REASON_SHAPE_MISMATCH,
                    f"layer {layer} {module}: lora_{which} has shape {got}, the backbone needs "
                    f"{need} (rank {rank}, in {in_features}, out {out_features})",
                )
    if len(dtypes) != 1:
        raise AdapterProblem(REASON_WEIGHTS_INVALID, f"{weights} mixes dtypes {sorted(dtypes)}")
    return AdapterInfo(
        path=str(adapter_dir),
        rank=checked.rank,
        alpha=checked.alpha,
        target_modules=modules,
        dtype=dtypes.pop(),
        num_tensors=2 * len(seen),
        use_rslora=checked.use_rslora,
        layers=sorted({layer for layer, _ in seen}),
        ranks=ranks,
    )


def parse_api_keys(text: str) -> list[str]:
    """API keys in a Secret value: one per line (or comma-separated); blanks and # comments ignored."""
    keys = []
    for line in text.replace(",", "\n").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def shared_adapter_dirs(
    adapter_dirs: dict[str, str], resolve: Callable[[str], str] = os.path.realpath
) -> dict[str, str]:
    """Functions whose adapter directory is also another function's (the same directory, or one inside
    the other), judged on real paths: a symlink or `..` does not hide it (issue 15). function -> warning.

    `adapter_dirs`: function -> its adapter directory as registered. Locally this is a warning (one user
    owns every function); on Kubernetes the URI allow-lists decide (`lorafn.api.uris.ClusterURIPolicy`).
    Pure apart from `resolve`."""
    real = {fn: resolve(d) for fn, d in adapter_dirs.items()}
    out: dict[str, str] = {}
    for fn, mine in sorted(real.items()):
        for other, theirs in sorted(real.items()):
            if other == fn or not (_inside(mine, theirs) or _inside(theirs, mine)):
                continue
            via = f" (really {mine})" if mine != adapter_dirs[fn] else ""
            how = "is" if mine == theirs else "overlaps"
            out[fn] = (
                f"adapter directory {adapter_dirs[fn]}{via} {how} the adapter directory of function "
                f"{other} ({theirs}): one function can read the other's adapter"
            )
            break
    return out
