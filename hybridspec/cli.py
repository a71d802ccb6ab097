"""`hybridspec` command line: each face registers its own sub-command; modules load only when their command runs."""
from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> module exposing `register(subparsers)`, which adds a parser whose `func(args) -> int` runs it.
COMMANDS = {
    "calibrate": "hybridspec.model.calibration",
    "demo": "hybridspec.tools.demo",
    "gpu-run": "hybridspec.tools.gpu_run",
    "replay": "hybridspec.agent_traces.cli",
    "serve": "hybridspec.serve",
    "train": "hybridspec.tools.train",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="hybridspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    for name, module in COMMANDS.items():
        if wanted is not None and name != wanted:
            sub.add_parser(name)
            continue
        try:
            importlib.import_module(module).register(sub)
        except ModuleNotFoundError as e:
            if not e.name or not module.startswith(e.name):
                raise
            sub.add_parser(name, help="(not available in this build)")
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.error(f"command {args.command!r} is not available")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
