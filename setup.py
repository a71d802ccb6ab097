"""Build glue: maps the user-facing folders onto the `hybridspec.*` namespace and compiles the suffix tree.

The repository root shows the architecture (suffix/, verifier/, ...); their import names live under `hybridspec.` so
that nothing clashes with PyPI packages such as `speculators`. Metadata is in pyproject.toml.
"""
from setuptools import Extension, find_packages, setup

FOLDERS = ["suffix", "speculators", "router", "verifier", "agent_traces"]

package_dir = {"hybridspec": "hybridspec"}
packages = ["hybridspec"] + [f"hybridspec.{p}" for p in find_packages("hybridspec")]
for folder in FOLDERS:
    package_dir[f"hybridspec.{folder}"] = folder
    packages.append(f"hybridspec.{folder}")
    for sub in find_packages(folder):
        package_dir[f"hybridspec.{folder}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
        packages.append(f"hybridspec.{folder}.{sub}")

ext = Extension(
    "hybridspec.suffix._tree",
    sources=["suffix/_tree.pyx"],
    depends=[f"suffix/_tree_{part}.pxi" for part in ("nodes", "insert", "draft", "speculate")],  # included by _tree.pyx
    extra_compile_args=["-O3"],
)
# the attention of decode steps on a CPU (threaded as the products below); its AVX-512 code is compiled for that
# target only and runs where the CPU has it (hybridspec.model.attention falls back to PyTorch's attention elsewhere)
attention = Extension(
    "hybridspec.model._attention",
    sources=["hybridspec/model/_attention.pyx"],
    depends=["hybridspec/model/attention_kernel.h"],
    include_dirs=["hybridspec/model"],
    extra_compile_args=["-O3", "-fopenmp"],
    extra_link_args=["-fopenmp"],
)
# the products of decode and verification steps (a few rows) on a CPU, threaded by OpenMP: torch is imported first
# and the extension shares its libgomp, so both use one pool of threads
products = Extension(
    "hybridspec.model._products",
    sources=["hybridspec/model/_products.pyx"],
    depends=[f"hybridspec/model/{name}_kernel.h" for name in ("product", "head", "moe", "norm", "delta", "amx")],
    include_dirs=["hybridspec/model"],
    extra_compile_args=["-O3", "-fopenmp"],
    extra_link_args=["-fopenmp"],
)

setup(
    package_dir=package_dir,
    packages=packages,
    # the shipped recipes (ablations too), drafter checkpoints and chat templates; only these patterns: their folders
    # are data, not packages
    # (the heads in their compact form; the plain model.safetensors that `compact expand` writes beside them is not
    # shipped: the runtime reads the compact file)
    package_data={"hybridspec.speculators": ["checkpoints/*/config.json", "checkpoints/*/model.safetensors.q8",
                                             "checkpoints/*/train_log.json", "recipes/*.yaml",
                                             "recipes/ablations/*.yaml"],
                  "hybridspec.grammar": ["templates/*.jinja"]},
    include_package_data=False,
    ext_modules=[ext, attention, products],
)
