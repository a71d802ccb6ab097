"""The machine a result was measured (or a drafter trained) on: what benchmarks' JSON and train logs record; and
what the engine measured on this machine, kept in the user cache (`measured_here`, `keep_measured`)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any, Callable


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


def physical_cores() -> int:
    """The physical cores this process may run on (hyper-threads of one core count once), within a container's CPU
    quota where one is set: the torch threads the engine runs with by default (a second thread on one core only
    contends for its vector units)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "physical_package_id") as p, open(base + "core_id") as c:
                cores.add((p.read().strip(), c.read().strip()))
        except OSError:
            cores.add(("", str(cpu)))
    quota = _cgroup_cpu_quota()
    return max(1, min(len(cores), quota) if quota else len(cores))


def _cgroup_cpu_quota() -> int | None:
    """A container's CPU limit in whole CPUs (cgroup v2 cpu.max, v1 cfs quota), rounded up; None when unlimited."""
    for path, split in (("/sys/fs/cgroup/cpu.max", lambda s: s.split()),
                        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", None)):
        try:
            with open(path) as f:
                text = f.read()
            if split is not None:
                quota, period = split(text)
            else:
                with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
                    quota, period = text.strip(), f.read().strip()
            if quota in ("max", "-1"):
                return None
            return max(1, -(-int(quota) // int(period)))
        except (OSError, ValueError):
            continue
    return None


def memory_limit_bytes() -> int:
    """The memory this process may use: a container's limit (cgroup v2 memory.max, v1 memory.limit_in_bytes) where
    one is set below the machine's, else the machine's physical memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
            if text != "max" and 0 < int(text) < physical:
                return int(text)
        except (OSError, ValueError):
            continue
    return physical


def resident_bytes() -> int:
    """This process's resident memory now (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_free_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc keeps them after a burst of requests, and the
    resident memory would stay at the burst's peak); a no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def limit_allocator_arenas(count: int = 2) -> bool:
    """Keep glibc's allocator to `count` arenas for the threads created after this call (a no-op elsewhere).

    A server's steps run on the engine's loop thread (started again after each idle spell) and its requests are
    checked on a pool of threads; by default glibc gives busy threads arenas of their own (up to 8 per core), each
    keeping the free pages of the work it did, so a long burst grows resident memory past the KV budget. Only one
    step runs at a time, so few arenas cost no contention. Returns whether the allocator took the setting."""
    try:
        import ctypes

        M_ARENA_MAX = -8  # glibc's malloc.h
        return ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, count) == 1
    except (OSError, AttributeError):
        return False


def set_threads(threads: int | None = None) -> int:
    """Run torch's CPU work on `threads` threads (None: this machine's physical cores, `physical_cores`); returns the
    count."""
    import torch

    count = physical_cores() if threads is None else threads
    if count < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(count)
    return count


def work_clock() -> Callable[[], float]:
    """The clock to time this process's torch work by when measuring what it costs: on one torch thread the calling
    thread's CPU time (the work runs there, and time other processes take from the core does not count, so a
    calibration made beside other work still measures this machine), else the wall clock (the threads' CPU time
    would count their spinning; take the fastest of several repeats then: interference only adds time)."""
    import torch

    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
