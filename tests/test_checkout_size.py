"""A checkout that travels (issue 35): the files a clone holds (tracked, and new ones not ignored) stay within 40 MiB
in all, none of them reaching 16 MiB, so the whole tree can be copied to a remote machine with room to spare. The
shipped drafter heads are what weighs: they are tracked in their compact 8-bit form (model.safetensors.q8); the plain
model.safetensors that vLLM reads is written beside them by `python -m hybridspec.speculators.compact expand` and
git-ignored."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MiB = 2 ** 20
MAX_TREE, MAX_FILE = 40 * MiB, 16 * MiB


def tree_files() -> dict[str, int]:
    """Size of each file git tracks or would add (not ignored), as it is in the working tree."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    sizes = {}
    for name in out.decode().split("\0"):
        path = ROOT / name
        if name and path.is_file() and not path.is_symlink():
            sizes[name] = path.stat().st_size
    return sizes


def test_the_tree_fits_in_40_mib_and_no_file_reaches_16_mib():
    sizes = tree_files()
    total = sum(sizes.values())
    biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:8]
    report = ", ".join(f"{name} {size / MiB:.1f} MiB" for name, size in biggest)
    assert total <= MAX_TREE, f"the tree holds {total / MiB:.1f} MiB (limit 40); the largest: {report}"
    big = {name: size for name, size in sizes.items() if size >= MAX_FILE}
    assert not big, f"files of 16 MiB or more: {big}"


def test_expanded_heads_are_ignored_and_compact_heads_are_not():
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index",
                              "speculators/checkpoints/peagle-smollm2/model.safetensors",
                              "speculators/checkpoints/peagle-smollm2/model.safetensors.q8"],
                             capture_output=True, text=True)
    except OSError:
        pytest.skip("no git")
    if out.returncode == 128:
        pytest.skip("not a git checkout")
    assert out.stdout.split() == ["speculators/checkpoints/peagle-smollm2/model.safetensors"]
