"""The plugin's switches, versions and its one error type: what both the patches and the proposers read."""
from __future__ import annotations

import logging
import os

# The vLLM release series whose internals the patches are written for (each patch may name the series it applies to).
SUPPORTED_VLLM_SERIES: tuple[str, ...] = ("0.32", "0.33")
SUPPORTED_VLLM_RANGE = ">=0.32,<0.34"  # the same, as pyproject's requirement writes it
ENV_SWITCH = "HYBRIDSPEC_VLLM"
ENV_OBSERVER = "HYBRIDSPEC_VLLM_OBSERVER"  # "module:Class": Class(config) gets event(kind, rid, **fields) calls
# The engine's cost gate on vLLM's drafts: "measure" (tables refitted to vLLM's own passes, router/measured.py),
# "default" (the built-in CPU tables of SmolLM2, router/cost.py) or the JSON of `benchmarks/bench_verify_cost.py`;
# unset: every draft is verified in full, as vLLM's own methods do.
ENV_VERIFY_COST = "HYBRIDSPEC_VLLM_VERIFY_COST"
MODES = ("suffix", "hybrid", "fasteagle")
HYBRID_METHODS = ("eagle", "eagle3")

logger = logging.getLogger("vllm.hybridspec")  # a child of vLLM's logger: its handler and format


class PluginError(SystemExit):
    """A request for the plugin that cannot be honoured. A SystemExit, so that vLLM's plugin loader (which logs and
    ignores ordinary exceptions) does not go on serving without what the user asked for."""

    def __init__(self, message: str) -> None:
        super().__init__(f"hybridspec vLLM plugin: {message}")


def requested_modes(value: str | None = None) -> frozenset[str]:
    """The modes HYBRIDSPEC_VLLM asks for (`value` instead of the environment's, if given); empty: the plugin is off."""
    raw = os.environ.get(ENV_SWITCH, "") if value is None else value
    if raw.strip().lower() in ("", "0", "off", "false", "no"):
        return frozenset()
    modes = {part.strip().lower() for part in raw.split(",") if part.strip()}
    unknown = sorted(modes - set(MODES))
    if unknown:
        raise PluginError(f"{ENV_SWITCH}={raw!r}: unknown mode {', '.join(map(repr, unknown))}; use one of "
                          f"{', '.join(MODES)} (comma-separated for several), or unset it to leave vLLM as it is")
    return frozenset(modes)


def vllm_series(version: str) -> str | None:
    """"0.33" for "0.33.0", "0.33.1+cpu" or "0.33.2.dev4+g1234"; None where the version cannot be read."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        return None
    return ".".join(map(str, release[:2])) if len(release) >= 2 else None


def check_vllm_version(version: str) -> str:
    """The supported series `version` belongs to; otherwise a PluginError that names the range (vLLM untouched)."""
    series = vllm_series(version)
    if series not in SUPPORTED_VLLM_SERIES:
        raise PluginError(f"vLLM {version} is not supported (this hybridspec supports vLLM {SUPPORTED_VLLM_RANGE}, "
                          f"the series {', '.join(s + '.x' for s in SUPPORTED_VLLM_SERIES)}: it replaces parts of vLLM "
                          f"that are not public API); nothing was changed. Install a supported vLLM, or unset "
                          f"{ENV_SWITCH} to run vLLM without hybridspec.")
    return series


def announce(method: str, by: str) -> None:
    """The one line that says hybridspec took a speculative method over in this process."""
    from hybridspec import __version__

    logger.info("hybridspec %s: vLLM's speculative method %r is served by %s", __version__, method, by)
