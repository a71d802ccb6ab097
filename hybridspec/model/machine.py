"""The machine a result was measured (or a drafter trained) on: what benchmarks' JSON and train logs record; and
what the engine measured on this machine, kept in the user cache (`measured_here`, `keep_measured`)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import tempfile
from typing import Any


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """The machine a result was measured on. torch's fields only where the benchmark imported torch (the peers'
    environment has none)."""
    torch = sys.modules.get("torch")
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": getattr(torch, "__version__", None), "threads": torch.get_num_threads() if torch else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def machine_key() -> str:
    """What a measurement of the engine's speed holds for: the CPU, its count, torch's version and thread count."""
    import torch

    return f"{cpu_model()} | {os.cpu_count()} cpus | torch {torch.__version__} | {torch.get_num_threads()} threads"


def measured_here(filename: str) -> dict[str, Any]:
    """This machine's entries in `filename` of the user cache ({machine_key(): {key: measurement}}); {} if none."""
    from hybridspec.model.loading import cache_dir

    try:
        return json.loads((cache_dir() / filename).read_text()).get(machine_key(), {})
    except (OSError, ValueError):
        return {}


def keep_measured(filename: str, entries: dict[str, Any]) -> None:
    """Make `entries` this machine's in `filename` of the user cache, other machines' left as they are. Written to a
    temporary file and renamed into place, so a reader never sees half a file; a read-only cache keeps nothing."""
    from hybridspec.model.loading import cache_dir

    path = cache_dir() / filename
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    stored[machine_key()] = entries
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(stored, f, indent=1)
        os.replace(f.name, path)
    except OSError:
        pass
