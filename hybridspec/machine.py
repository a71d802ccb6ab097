"""The machine a result was measured (or a drafter trained) on: what benchmarks' JSON and train logs record."""
from __future__ import annotations

import datetime
import os
import platform
import sys
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
