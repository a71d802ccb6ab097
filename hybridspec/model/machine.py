"""The machine a result was measured (or a drafter trained) on: what benchmarks' JSON and train logs record; and
what the engine measured on this machine, kept in the user cache (`measured_here`, `keep_measured`)."""
from __future__ import annotations

import datetime
import functools
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


@functools.lru_cache(maxsize=1)
def _glibc():
    """glibc, through ctypes (OSError where there is none)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def release_free_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc keeps them after a burst of requests, and the
    resident memory would stay at the burst's peak); a no-op elsewhere."""
    try:
        _glibc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def ask_for_huge_pages(address: int, nbytes: int) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside [address, address + nbytes) with huge pages, before anything is
    written there (where transparent huge pages are on `madvise`, as is common). Why: glibc maps a large block afresh
    on each allocation and its first write faults in every 4 KiB page, one fault per 4 KiB of a call's KV cache (a
    512-token prompt's on a 0.6B model: 140 MB) where huge pages take one per 2 MiB. False where the system said no."""
    start, end = -(-address // _HUGE_PAGE) * _HUGE_PAGE, (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return False
    try:
        return _glibc().madvise(start, end - start, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def release_openmp_threads() -> None:
    """End the calling thread's idle OpenMP team, if it has one (its next parallel region starts a new one).

    Why: libgomp lets a waiting worker spin, and so start the next parallel region at once, only while it manages no
    more threads than the process has CPUs; past that every region wakes its workers through the kernel, slow on a
    virtual machine. The engine's steps run on its loop thread, whose team comes on top of the one a caller keeps after
    loading the model or running torch work of its own, and every region of every step would be the slow kind. So a
    caller releases its team when it hands the loop a call."""
    try:
        from hybridspec.model import _products
    except ImportError:  # pragma: no cover - a build without the kernels
        return
    _products.release_threads()


def limit_allocator_arenas(count: int = 2) -> bool:
    """Keep glibc's allocator to `count` arenas for the threads created after this call (a no-op elsewhere).

    A server's steps run on the engine's loop thread (started again after each idle spell) and its requests are
    checked on a pool of threads; by default glibc gives busy threads arenas of their own (up to 8 per core), each
    keeping the free pages of the work it did, so a long burst grows resident memory past the KV budget. Only one
    step runs at a time, so few arenas cost no contention. Returns whether the allocator took the setting."""
    try:
        M_ARENA_MAX = -8  # glibc's malloc.h
        return _glibc().mallopt(M_ARENA_MAX, count) == 1
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
