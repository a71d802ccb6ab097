"""Real agent calls as frameworks make them, for the benchmarks that replay them: stateless calls, each re-sending the
whole conversation as logged, consecutive calls of a few trajectories of SWE-agent, mini-swe-agent and AutoCodeRover
(../shared/agent_traces).

Light on purpose: it imports neither torch nor vLLM, so the same loader serves .venv (our engine, transformers) and
.venv-vllm (the vLLM benchmarks); `tokenizer` is any Hugging Face tokenizer with a chat template.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import TRACES_DIR

SMOLLM2_CONTEXT = 8192  # the embedded model's context: prompts leave room for the new tokens in it

# Trajectories are dealt round-robin over the frameworks in this order (folder names start with these, then "__").
FRAMEWORK_ORDER = ("SWE-agent", "mini-swe-agent", "AutoCodeRover")
DEFAULT_MAX_PROMPT_TOKENS = 8192 - 128  # SmolLM2's context less the 128 new tokens of the benchmarks


@dataclass
class AgentCall:
    """One logged LLM call: its trajectory ("<framework folder>/<session id>"), its index among that trajectory's
    calls, the messages sent (role and content only) and their token ids (chat template, generation prompt added).
    `workload` is what a benchmark's summaries break it down by: its framework unless given (a benchmark that mixes
    workloads: "agent", and "chat" or "code" for single prompts)."""

    trajectory: str
    index: int
    messages: list[dict[str, str]]
    prompt_token_ids: list[int]
    workload: str = ""

    def __post_init__(self) -> None:
        self.workload = self.workload or self.framework

    @property
    def framework(self) -> str:
        """The agent framework, e.g. "SWE-agent" (the trace folder's name up to "__")."""
        return self.trajectory.split("/", 1)[0].split("__", 1)[0]


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's token ids as `Engine.encode(messages)` makes them: the chat template with the generation prompt."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


def prompt_calls(workload: str, name: str, prompts: list[str], tokenizer: Any) -> list[AgentCall]:
    """Single-turn prompts as calls of `workload`: the user message through the chat template."""
    messages = [[{"role": "user", "content": p}] for p in prompts]
    return [AgentCall(name, i, m, chat_token_ids(tokenizer, m), workload) for i, m in enumerate(messages)]


def framework_dirs(traces_dir: Path) -> list[Path]:
    """The framework folders under `traces_dir`, those of FRAMEWORK_ORDER first in that order, then any other."""
    def rank(path: Path) -> tuple[int, str]:
        name = path.name.split("__", 1)[0]
        return (FRAMEWORK_ORDER.index(name) if name in FRAMEWORK_ORDER else len(FRAMEWORK_ORDER), path.name)

    return sorted((p for p in Path(traces_dir).iterdir() if p.is_dir()), key=rank)


def load_agent_calls(tokenizer: Any, *, trajectories: int = 4, calls_per_trajectory: int = 3,
                     max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
                     traces_dir: Path = TRACES_DIR) -> list[list[AgentCall]]:
    """`trajectories` trajectories, dealt round-robin over the frameworks (SWE-agent, mini-swe-agent, AutoCodeRover,
    SWE-agent, ...; within a framework by session id), each with its first `calls_per_trajectory` calls whose prompt
    has at most `max_prompt_tokens` tokens, in call order. Longer calls are skipped (counted on stderr); a trajectory
    with too few calls that fit is passed over for the framework's next one."""
    from hybridspec.agent_traces.formats import load_traces

    if trajectories < 1 or calls_per_trajectory < 1:
        raise ValueError("trajectories and calls_per_trajectory must be at least 1")
    # lazily per framework: tokenizing a whole framework's calls takes long, the first few trajectories suffice
    queues = {d.name: iter(sorted(load_traces(d).trajectories, key=lambda t: t.session_id))
              for d in framework_dirs(traces_dir)}
    chosen: list[list[AgentCall]] = []
    skipped_calls = passed_over = 0
    while len(chosen) < trajectories and queues:
        for folder in list(queues):
            if len(chosen) == trajectories:
                break
            for trajectory in queues[folder]:
                calls, skipped = _first_calls(trajectory, folder, tokenizer, calls_per_trajectory, max_prompt_tokens)
                skipped_calls += skipped
                if len(calls) == calls_per_trajectory:
                    chosen.append(calls)
                    break
                passed_over += 1  # too few calls fit: the framework's next trajectory instead
            else:
                del queues[folder]  # no trajectory of this framework is left
    if len(chosen) < trajectories:
        raise ValueError(f"only {len(chosen)} trajectories under {traces_dir} have {calls_per_trajectory} calls of at "
                         f"most {max_prompt_tokens} prompt tokens; {trajectories} were asked for")
    if skipped_calls or passed_over:
        print(f"agent calls: skipped {skipped_calls} calls of more than {max_prompt_tokens} prompt tokens; passed over "
              f"{passed_over} trajectories with fewer than {calls_per_trajectory} calls that fit", file=sys.stderr)
    return chosen


def _first_calls(trajectory: Any, folder: str, tokenizer: Any, count: int,
                 max_prompt_tokens: int) -> tuple[list[AgentCall], int]:
    """The first `count` calls of `trajectory` that fit, and how many longer ones were skipped on the way."""
    calls, skipped = [], 0
    for call in trajectory.calls:
        if not call.messages:
            continue
        messages = [{"role": m["role"], "content": m["content"]} for m in call.messages]
        ids = chat_token_ids(tokenizer, messages)
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        calls.append(AgentCall(f"{folder}/{trajectory.session_id}", call.index, messages, ids))
        if len(calls) == count:
            break
    return calls, skipped


def load_replay(model: str, trajectories: int, calls_per_trajectory: int, max_new_tokens: int, traces_dir: Path,
                what: str) -> tuple[Path, Any, list[list[AgentCall]]]:
    """The model's directory and tokenizer and the agent calls a replay sends (prompts up to SmolLM2's context less
    the new tokens), after one line on stderr saying what runs (`what`)."""
    from hybridspec.model.loading import load_tokenizer, resolve_model

    model_dir = resolve_model(model)
    tokenizer = load_tokenizer(model_dir)
    replay = load_agent_calls(tokenizer, trajectories=trajectories, calls_per_trajectory=calls_per_trajectory,
                              max_prompt_tokens=SMOLLM2_CONTEXT - max_new_tokens, traces_dir=traces_dir)
    sizes = [len(c.prompt_token_ids) for calls in replay for c in calls]
    print(f"{len(replay)} trajectories x {calls_per_trajectory} calls, prompts of {min(sizes)}-{max(sizes)} tokens; "
          f"{what}", file=sys.stderr)
    return model_dir, tokenizer, replay
