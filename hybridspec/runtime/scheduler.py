"""The scheduler: what each running call does in the next step, as a typed plan (`StepPlan`) the step runs.

Every running call is in every step (continuous batching: one pass of the target verifies every call's draft). A
call with a pending prompt first copies what other running calls have computed of it, then the step's prompt tokens
are shared out (`Prefill.allot`: half to the oldest prompt, the rest shortest first); a call whose prompt got no share
sits the step out, and one whose last chunk runs in this pass decodes with it. Each row of a decoding call gets its
draft budget (`draft_budget`: no more than asked, than the context holds, or than are still wanted).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hybridspec.router import StepLoad
from hybridspec.runtime.call import CallState
from hybridspec.runtime.commit import draft_budget
from hybridspec.runtime.prefill import Prefill, PromptChunk


@dataclass(eq=False)
class CallPlan:
    """One call's part of a step: the prompt tokens it runs in the pass (`chunk`; `chunk.features`: how many of the
    chunk's last positions' target features its drafter reads), and where it decodes (`chunk.decodes`), each row's
    draft budget (rows as the call's `rows`)."""

    call: CallState
    chunk: PromptChunk
    budgets: list[int] = field(default_factory=list)

    @property
    def decodes(self) -> bool:
        return self.chunk.decodes


@dataclass
class StepPlan:
    """One step: the calls' parts, and the last step's load (what a draft token cost then), which the proposers
    price drafts by (None: a row alone)."""

    calls: list[CallPlan]
    load: StepLoad | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.chunk.tokens) for p in self.calls)


class Scheduler:
    """Plans steps over an engine's running calls (`schedule`), its prompts through `prefill`."""

    def __init__(self, prefill: Prefill) -> None:
        self.prefill = prefill

    def schedule(self, running: list[CallState], load: StepLoad | None = None) -> StepPlan:
        """The next step of the `running` calls (oldest first). A call whose prompt sharing fails fails alone."""
        calls = []
        for call in running:
            try:
                if self.prefill.share(call, running):
                    calls.append(call)
            except Exception as e:  # noqa: BLE001 - one call's failure must not end the others'
                call.fail(e)
        plans = []
        for call, share in zip(calls, self.prefill.allot(calls)):
            chunk = self.prefill.chunk(call, share)
            if not (chunk.decodes or chunk.tokens):
                continue  # its prompt got no share of this step
            budgets = [draft_budget(call.resolved.num_speculative_tokens, len(call.seqs[i].tokens),
                                    len(call.seqs[i].generated), call.rules) for i in call.rows] \
                if chunk.decodes else []
            plans.append(CallPlan(call, chunk, budgets))
        return StepPlan(plans, load)
