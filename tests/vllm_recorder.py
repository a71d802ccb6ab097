"""The observer the vLLM plugin tests hand to `hybridspec.vllm_plugin` (HYBRIDSPEC_VLLM_OBSERVER=vllm_recorder:Recorder,
this folder on PYTHONPATH): appends one JSON line per life-cycle event to $HYBRIDSPEC_VLLM_RECORD/<pid>-<n>.jsonl, what
the tests replay through a fresh SuffixCache."""
from __future__ import annotations

import json
import os
from typing import Any, Hashable

ENV_RECORD = "HYBRIDSPEC_VLLM_RECORD"


class Recorder:
    _count = 0

    def __init__(self, config: dict) -> None:
        directory = os.environ[ENV_RECORD]
        os.makedirs(directory, exist_ok=True)
        Recorder._count += 1
        self.path = os.path.join(directory, f"{os.getpid()}-{Recorder._count}.jsonl")
        self._file = open(self.path, "a", buffering=1)
        self.event("config", None, **config)

    def event(self, kind: str, rid: Hashable | None, **fields: Any) -> None:
        self._file.write(json.dumps({"event": kind, "rid": rid, **fields}) + "\n")
