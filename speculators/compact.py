"""The shipped heads' two forms on disk, from the command line.

    python -m hybridspec.speculators.compact expand [DIR ...]    # model.safetensors (bfloat16) beside each compact
                                                                 # head, for vLLM; default: every shipped head
    python -m hybridspec.speculators.compact compress DIR ...    # a plain checkpoint into its compact form

The shipped heads are tracked as model.safetensors.q8 (8-bit, `quantize.py`); the plain file that `expand` writes is
git-ignored and written again when the compact file changes (scripts/setup.sh runs `expand`).
"""
from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

from hybridspec.speculators.formats import COMPACT_WEIGHTS, CONFIG, WEIGHTS, compress_checkpoint, expand_checkpoint


def shipped_dirs() -> list[Path]:
    """The directories of the heads shipped as package data (a checkout, an editable install or a wheel)."""
    root = Path(str(resources.files("hybridspec.speculators") / "checkpoints"))
    return sorted(p for p in root.iterdir() if (p / CONFIG).is_file()) if root.is_dir() else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridspec.speculators.compact", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    expand = sub.add_parser("expand", help="write model.safetensors beside each compact head (vLLM reads it)")
    expand.add_argument("dirs", nargs="*", type=Path, help="checkpoint directories (default: the shipped heads)")
    compress = sub.add_parser("compress", help="rewrite plain checkpoints in the compact form")
    compress.add_argument("dirs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    if args.command == "expand":
        for d in args.dirs or shipped_dirs():
            if (d / COMPACT_WEIGHTS).is_file():
                print(expand_checkpoint(d) / WEIGHTS)
    else:
        for d in args.dirs:
            print(compress_checkpoint(d))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
