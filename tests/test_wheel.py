"""An installed wheel works on its own: built from an sdist of the working tree (so the sdist holds everything the
build needs: the Cython sources, their includes, the attention kernel's header), installed into a fresh directory,
imported from there with the checkout out of reach, it finds its shipped drafter heads, recipes and chat template as
package data (the heads in their compact form), and its P-EAGLE and FastEagle heads draft greedy output equal to the
target's own."""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
from setuptools import find_packages

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("peagle", "fasteagle", "lstm", "eagle3")
# top-level entries the build does not read (hidden ones are skipped too: git, the virtual environments)
SKIP_TOP = {"build", "out", "shared", "tests", "benchmarks", "examples"}
# model.safetensors: the shipped heads' plain weights, git-ignored (written beside their compact file for vLLM)
SKIP_ANY = ("__pycache__", "*.so", "*.html", "*.egg-info", "*.pyc", "model.safetensors")


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out


def _build_outputs(directory: str, names: list[str]) -> set[str]:
    """Names in `directory` that a build makes: compiled modules, caches, and the C that Cython writes from a .pyx."""
    generated_c = {n for n in names if n.endswith(".c") and n[:-2] + ".pyx" in names}
    return set(shutil.ignore_patterns(*SKIP_ANY)(directory, names)) | generated_c


def _copy_tree(dst: Path) -> None:
    """The working tree as a fresh clone would have it, build outputs left out (the build makes them again)."""
    dst.mkdir()
    for entry in ROOT.iterdir():
        if entry.name.startswith(".") or entry.name in SKIP_TOP or _build_outputs(str(ROOT), [entry.name]):
            continue
        if entry.is_dir():
            shutil.copytree(entry, dst / entry.name, ignore=_build_outputs)
        else:
            shutil.copy2(entry, dst / entry.name)


def _package_dirs(src: Path) -> dict[str, Path]:
    """Each package's directory in `src`, by its path in the wheel: setup.py's mapping of the root's folders."""
    tree = ast.parse((src / "setup.py").read_text())
    folders = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "FOLDERS" for t in node.targets))
    dirs = {"hybridspec": src / "hybridspec"}
    dirs.update({f"hybridspec/{sub.replace('.', '/')}": src / "hybridspec" / sub.replace(".", "/")
                 for sub in find_packages(str(src / "hybridspec"))})
    for folder in folders:
        dirs[f"hybridspec/{folder}"] = src / folder
        dirs.update({f"hybridspec/{folder}/{sub.replace('.', '/')}": src / folder / sub.replace(".", "/")
                     for sub in find_packages(str(src / folder))})
    return dirs


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """An sdist of a copy of the working tree, and the wheel pip builds from that sdist (both extensions compiled)."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    _copy_tree(src)
    _run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(base / 'sdist')!r})"],
         cwd=src)
    sdist = next((base / "sdist").glob("*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(base / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    unpacked = next((base / "unpacked").iterdir())
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(unpacked),
          "-w", str(base / "dist")], cwd=base)
    wheel = next((base / "dist").glob("hybridspec-*.whl"))
    return {"src": src, "sdist": sdist, "wheel": wheel, "base": base}


def test_wheel_holds_every_module_head_recipe_and_extension_once(built):
    src = built["src"]
    names = zipfile.ZipFile(built["wheel"]).namelist()
    assert len(names) == len(set(names)), "duplicate entries in the wheel"
    files = [n for n in names if not n.endswith("/")]
    dist_info = "-".join(built["wheel"].name.split("-")[:2]) + ".dist-info"
    assert {n.split("/")[0] for n in files} == {"hybridspec", dist_info}

    # every module of every mapped package, and no other Python file (no tests, benchmarks, scripts)
    expected_py = {f"{where}/{f.name}" for where, d in _package_dirs(src).items() for f in d.glob("*.py")}
    assert {n for n in files if n.endswith(".py")} == expected_py

    ckpt = "hybridspec/speculators/checkpoints/"
    shipped = {p.relative_to(src / "speculators/checkpoints").as_posix()
               for p in (src / "speculators/checkpoints").rglob("*") if p.is_file()}
    assert {n[len(ckpt):] for n in files if n.startswith(ckpt)} == shipped
    for kind in KINDS:
        assert {f"{kind}-smollm2/{f}" for f in ("config.json", "model.safetensors.q8")} <= shipped, kind
    assert not any(n.endswith("/model.safetensors") for n in files)  # the compact heads only

    recipes = "hybridspec/speculators/recipes/"
    expected_recipes = {p.relative_to(src / "speculators/recipes").as_posix()
                        for p in (src / "speculators/recipes").rglob("*.yaml")}
    assert any(r.startswith("ablations/") for r in expected_recipes)
    assert {n[len(recipes):] for n in files if n.startswith(recipes)} == expected_recipes

    templates = "hybridspec/grammar/templates/"
    expected_templates = {p.name for p in (src / "hybridspec/grammar/templates").glob("*.jinja")}
    assert "chatml_tools.jinja" in expected_templates
    assert {n[len(templates):] for n in files if n.startswith(templates)} == expected_templates

    extensions = sorted(n for n in files if n.endswith(".so"))
    assert [n.split(".")[0] for n in extensions] == ["hybridspec/model/_attention", "hybridspec/model/_products",
                                                   "hybridspec/suffix/_tree"]

    data = {n for n in files if n.startswith((ckpt, recipes, templates))}
    other = {n for n in files if not n.endswith((".py", ".so")) and n not in data and ".dist-info/" not in n}
    assert not other, f"unexpected files in the wheel (build inputs or strays): {sorted(other)}"

    # the sdist the wheel was built from holds the extensions' build inputs
    sdist_names = {n.split("/", 1)[1] for n in tarfile.open(built["sdist"]).getnames() if "/" in n}
    pxi = {p.relative_to(src).as_posix() for p in (src / "suffix").glob("_tree*.pxi")}
    assert {"suffix/_tree.pyx", "hybridspec/model/_attention.pyx", "hybridspec/model/attention_kernel.h"} | pxi \
        <= sdist_names


CHILD = textwrap.dedent('''
    import json, os, sys
    site, checkout = sys.argv[1], sys.argv[2]
    # the checkout's editable install is a finder on sys.meta_path: without it, whatever is not in `site` fails
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != checkout]
    import torch
    torch.set_num_threads(1)
    from importlib import resources
    from hybridspec import Engine
    from hybridspec.runtime.prompts import tools_template
    from hybridspec.speculators.train import load_recipe

    data = resources.files("hybridspec.speculators")
    recipes = sorted(p.name for p in (data / "recipes").iterdir() if p.name.endswith(".yaml"))
    ablations = sorted(p.name for p in (data / "recipes" / "ablations").iterdir())
    drafters = [load_recipe(data / "recipes" / name).drafter for name in recipes]
    engine = Engine.from_pretrained("smollm2")
    prompt = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    out = {"data": str(data), "recipes": recipes, "ablations": ablations, "drafters": drafters,
           "none": engine.generate(prompt, max_new_tokens=24, speculate="none").token_ids}
    for kind in ("peagle", "fasteagle"):
        result = engine.generate(prompt, max_new_tokens=24, speculate=kind)
        out[kind] = {"tokens": result.token_ids, "drafter_runs": result.stats.drafter_runs,
                     "by_source": {k: vars(v) for k, v in result.stats.by_source.items()}}
    out["tools_template"] = tools_template()  # the chat template tools fall back to, as package data
    out["modules"] = sorted({getattr(m, "__file__", None) or "" for name, m in list(sys.modules.items())
                             if name == "hybridspec" or name.startswith("hybridspec.")})
    print("RESULT " + json.dumps(out))
''')


def test_installed_wheel_drafts_with_its_shipped_heads(built, tmp_path):
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
          str(built["wheel"])])
    work = tmp_path / "work"  # outside the checkout: the working directory is not where hybridspec comes from
    work.mkdir()
    (work / "child.py").write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = _run([sys.executable, str(work / "child.py"), str(site), str(ROOT)], cwd=work, env=env, timeout=600)
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])

    assert result["modules"] and all(m.startswith(str(site)) for m in result["modules"]), \
        [m for m in result["modules"] if not m.startswith(str(site))]
    assert any(m.endswith(".so") for m in result["modules"])  # the wheel's own compiled extensions were imported
    assert result["data"].startswith(str(site))
    assert sorted(result["drafters"]) == sorted(KINDS)
    assert result["tools_template"] == (built["src"] / "hybridspec/grammar/templates/chatml_tools.jinja").read_text()
    assert len(result["ablations"]) == len(list((built["src"] / "speculators/recipes/ablations").glob("*.yaml")))
    for kind in ("peagle", "fasteagle"):
        assert result[kind]["tokens"] == result["none"], kind  # greedy: exactly the target's own tokens
        counts = result[kind]["by_source"].get(kind, {})
        assert counts.get("won", 0) > 0 and counts.get("drafts", 0) > 0, (kind, result[kind])
        assert result[kind]["drafter_runs"] > 0, kind
