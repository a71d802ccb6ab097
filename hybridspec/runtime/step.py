"""The decode step: propose -> route -> verify -> update, for every call that joined it, in one pass of the target.

    steps = plan(calls)               # each call's part: its prompt chunk (positions shared by running calls copied)
    propose(steps)                    # every row's draft; a proposer drafts all the greedy rows it serves at once
    steps = each(steps, constrain)    # the part of each draft its grammar allows (and the tokens it forces)
    steps = route(steps)              # the part worth its cost in this pass, planned for all rows at once
    verify(steps)                     # one pass over every row's last token + draft, and the prompt chunks
    each(steps, update)               # commit the accepted tokens, feed the proposer, retire finished rows

Greedy: a draft token is kept while it equals the target's argmax; sampling: x is kept with probability
min(1, p_target(x) / p_draft(x)), else the target resamples from norm(max(0, p_target - p_draft)). So outputs are the
target's own whatever was drafted: speculation only changes how many tokens one pass commits. Under a grammar the
target's distributions are the masked ones at every position (`hybridspec.grammar.constraint`).
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from hybridspec.grammar.constraint import apply_mask
from hybridspec.model.inputs import StepInput, StepOutput
from hybridspec.model.target import TargetModel
from hybridspec.proposal import Proposal, speculate_each
from hybridspec.router import Router
from hybridspec.runtime.call import CallState, SequenceState
from hybridspec.runtime.commit import commit_tokens, draft_budget, stop_cut
from hybridspec.runtime.prefill import Prefill, PromptChunk
from hybridspec.runtime.prefix_cache import PrefixCache
from hybridspec.runtime.stats import PassTimes
from hybridspec.verifier import VerifyResult, process_logits, verify_batch


@dataclass(eq=False)
class CallStep:
    """One call's part of one step, filled in phase by phase (rows as the call's `rows`)."""

    call: CallState
    chunk: PromptChunk = field(default_factory=lambda: PromptChunk([]))  # the prompt tokens it runs in this pass
    proposals: list[Proposal] = field(default_factory=list)  # each row's draft as proposed
    drafts: list[Proposal] = field(default_factory=list)  # ... as routed: what the pass verifies
    forced: list[int] = field(default_factory=list)  # each row's draft: how many of its last tokens the grammar forced
    masks: list[torch.Tensor | None] = field(default_factory=list)  # each row's grammar masks for the pass (None: none)
    out: StepOutput | None = None
    results: list[VerifyResult] | None = None


def each(steps: Sequence[CallStep], work: Callable[[CallStep], Any], timer: str | None = None) -> list[CallStep]:
    """work(step) for every step whose call has not failed; the steps that go on. An exception ends its call alone
    (its own thread raises it) and the others go on; work returning False sits the step out."""
    going = []
    for step in steps:
        call = step.call
        if call.error is not None:
            continue
        try:
            with call.stats.timed(timer) if timer else contextlib.nullcontext():
                if work(step) is False:
                    continue
        except Exception as e:  # noqa: BLE001 - one call's failure must not end the others'
            call.fail(e)
            continue
        going.append(step)
    return going


def step_input(step: CallStep) -> StepInput:
    """A call's part of the step's pass: its prompt chunk, then (when it decodes) each row's last token and draft."""
    call, chunk = step.call, step.chunk
    if not chunk.decodes:
        return StepInput(call.cache, [], prompt=chunk.tokens, drafter_context=chunk.features)
    return StepInput(call.cache, [call.seqs[i].tokens[-1] for i in call.rows], [d.token_ids for d in step.drafts],
                     [d.parents for d in step.drafts], prompt=chunk.tokens, drafter_context=chunk.features,
                     token_masks=step.masks or None)


class StepRunner:
    """Runs decode steps (`__call__`) on `target` for an engine's calls: its router, prompts (`Prefill`), prefix
    cache (where finished rows leave their KV) and text decoding (stop strings)."""

    def __init__(self, target: TargetModel, router: Router, prefill: Prefill, prefix_cache: PrefixCache | None,
                 decode: Callable[[list[int]], str]) -> None:
        self.target, self.router, self.prefill = target, router, prefill
        self.prefix_cache, self.decode = prefix_cache, decode
        self.passes = PassTimes()

    def __call__(self, calls: list[CallState]) -> None:
        steps = self.plan(calls)
        self.propose([s for s in steps if s.chunk.decodes])
        steps = each(steps, self.constrain, "propose_s")
        steps = self.route(steps)
        self.verify(steps)
        each(steps, self.update, "update_s")

    def plan(self, calls: list[CallState]) -> list[CallStep]:
        """Each call's part of the step: first every call copies what running calls computed of its pending prompt
        (a call waits a step while one begun earlier runs those positions in this very pass), then the prompts take
        the step's prompt tokens (`Prefill.allot`: half to the oldest, the rest shortest first): a burst of cold
        prompts finishes one after another rather than all together at the end, and a short one does not wait for
        them. A call whose prompt got no share sits the step out."""
        steps = each([CallStep(c) for c in calls], lambda s: self.prefill.share(s.call, calls))
        for step, share in zip(steps, self.prefill.allot([s.call for s in steps])):
            step.chunk = self.prefill.chunk(step.call, share)
        return [s for s in steps if s.chunk.decodes or s.chunk.tokens]

    def propose(self, steps: list[CallStep]) -> None:
        """Each row's draft: no longer than the budget, the context left, or the tokens still wanted. The greedy
        calls of one proposer draft together (a drafter's one pass for all their rows); a sampling call alone, with
        its own generator. A proposer's failure ends the calls it drafted for."""
        groups: dict[Any, list[CallStep]] = {}
        for step in steps:
            call = step.call
            key = (id(call.proposer), call.params.tree) if call.params.temperature == 0 else id(call)
            groups.setdefault(key, []).append(step)
        for group in groups.values():
            start = time.perf_counter()
            first = group[0].call
            rows = [(step, i) for step in group for i in step.call.rows]
            budgets = [draft_budget(s.call.params.num_speculative_tokens, len(s.call.seqs[i].tokens),
                                    len(s.call.seqs[i].generated), s.call.rules) for s, i in rows]
            asked = [r for r, budget in enumerate(budgets) if first.proposer is not None and budget > 0]
            drafts = [Proposal.empty() for _ in rows]
            try:
                first.set_sampling()  # the proposer may serve other calls' sequences with other settings
                made = speculate_each(first.proposer, [rows[r][0].call.seqs[rows[r][1]].request_id for r in asked],
                                      [budgets[r] for r in asked], tree=first.params.tree) if asked else []
                for r, proposal in zip(asked, made):
                    if len(proposal) > budgets[r]:
                        raise ValueError(f"{type(first.proposer).__name__} proposed {len(proposal)} tokens; at most "
                                         f"{budgets[r]} were asked for")
                    drafts[r] = proposal
            except Exception as e:  # noqa: BLE001 - the calls of this proposer fail, not the step
                for step in group:
                    step.call.fail(e)
                continue
            for step in group:
                step.proposals = [d for (owner, _), d in zip(rows, drafts) if owner is step]
                step.call.stats.propose_s += time.perf_counter() - start

    def route(self, steps: list[CallStep]) -> list[CallStep]:
        """The part of every row's draft worth verifying in this pass: planned for the whole step where the router
        plans steps (`CostGate.plan`: by the pass's cost over all its rows and prompt tokens), else call by call;
        then each call's grammar masks. Returns the steps that go on (a router's failure ends the calls it routed)."""
        decoding = [s for s in steps if s.chunk.decodes]
        plan = getattr(self.router, "plan", None)
        if plan is None or not decoding:
            return each(steps, lambda s: self.take_route(s, None))
        contexts = [len(s.call.seqs[i].tokens) for s in decoding for i in s.call.rows]
        try:
            routed = plan([p for s in decoding for p in s.proposals], contexts,
                          sum(len(s.chunk.tokens) for s in steps))
            if len(routed) != len(contexts):
                raise ValueError(f"the router returned {len(routed)} proposals for {len(contexts)} sequences")
        except Exception as e:  # noqa: BLE001 - the calls it planned for fail, the rest go on
            for s in decoding:
                s.call.fail(e)
            return [s for s in steps if not s.chunk.decodes]
        parts, start = {}, 0
        for s in decoding:
            parts[id(s)], start = routed[start:start + len(s.proposals)], start + len(s.proposals)
        return each(steps, lambda s: self.take_route(s, parts.get(id(s))))

    def take_route(self, step: CallStep, routed: list[Proposal] | None) -> None:
        """A call's drafts as routed (None: route them now, the call alone); its grammar's masks for the pass."""
        call = step.call
        if not step.chunk.decodes:
            return
        proposals = step.proposals
        if routed is None:
            routed = self.router(proposals, [len(call.seqs[i].tokens) for i in call.rows])
        if len(routed) != len(proposals):
            raise ValueError(f"the router returned {len(routed)} proposals for {len(proposals)} sequences")
        if call.params.temperature > 0:
            # A sampled draft is verified as drawn: cutting it by its own tokens' probabilities would make the kept
            # tokens no longer follow the draft distribution the rejection rule assumes, and bias the output.
            routed = [p if p.draft_logits is not None else r for p, r in zip(proposals, routed)]
        call.stats.proposals += sum(1 for p in proposals if len(p))
        call.stats.skipped_proposals += sum(1 for p, r in zip(proposals, routed) if len(p) and not len(r))
        step.drafts = routed
        if call.constraints is not None:
            step.masks = [call.constraints[i].masks(d) for i, d in zip(call.rows, routed)]
            step.forced = [max(0, f - (len(p) - len(d))) for f, p, d in zip(step.forced, proposals, routed)]

    def constrain(self, step: CallStep) -> None:
        """Each row's draft under its grammar: a deterministic or greedy one cut at its first rejected token and
        extended with the tokens the grammar forces (`grammar_drafts`, while speculating); a sampled one redrawn from
        the drafter's masked distributions (cutting it would skew the sample: `Constraint.redraw`)."""
        call, p = step.call, step.call.params
        if not step.chunk.decodes or call.constraints is None:
            return
        forced = p.grammar_drafts and call.proposer is not None
        checked, step.forced = [], []
        for i, proposal in zip(call.rows, step.proposals):
            constraint, n = call.constraints[i], 0
            if p.temperature > 0 and proposal.draft_logits is not None:
                probs_fn = functools.partial(process_logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
                proposal = constraint.redraw(proposal, probs_fn, p.generator,
                                             keep_allowed=p.top_k == 0 and p.top_p == 1.0)
            else:
                seq = call.seqs[i]
                budget = draft_budget(p.num_speculative_tokens, len(seq.tokens), len(seq.generated), call.rules)
                proposal, n = constraint.check(proposal, budget, forced)
            checked.append(proposal)
            step.forced.append(n)
        step.proposals = checked

    def verify(self, steps: list[CallStep]) -> None:
        """One pass of the target over every call's part (`step_input`), then each call's acceptance rule.
        The pass's time is its calls' prefill when it ran prompt tokens of theirs, else their verification."""
        if not steps:
            return
        inputs = [step_input(s) for s in steps]
        start = time.perf_counter()
        try:
            outs = self.target.step_many(
                inputs, return_hidden=any(s.call.wants_target_features for s in steps),
                argmax_only=all(s.call.params.temperature == 0 for s in steps if s.chunk.decodes))
        except Exception as e:  # noqa: BLE001 - the pass failed for every call in it
            for step in steps:
                step.call.fail(e)
            return
        elapsed = time.perf_counter() - start
        self.passes.count(elapsed, prompt=any(s.chunk.tokens for s in steps))
        for step, out in zip(steps, outs):
            call, step.out = step.call, out
            self.prefill.gather(call, step.chunk, out)
            if step.chunk.tokens:
                call.stats.prefill_s += elapsed
            else:
                call.stats.verify_s += elapsed
            if step.chunk.decodes:
                p = call.params
                with call.stats.timed("verify_s"):
                    for row, (masks, draft) in enumerate(zip(step.masks, step.drafts)):
                        if masks is not None:
                            apply_mask(out.logits[row, :1 + len(draft)], masks)
                    step.results = verify_batch(out.logits, step.drafts, p.temperature, p.top_k, p.top_p, p.generator)

    def update(self, step: CallStep) -> None:
        """Commit each row's accepted tokens: the KV cache, the stop rules, the proposer, the statistics; then retire
        the rows that finished."""
        call = step.call
        self.prefill.hand_features(call)
        if step.results is None:  # a prompt chunk alone: nothing to commit yet
            return
        self.router.observe(step.drafts, [r.accepted for r in step.results])
        finished = []
        for row, (i, proposed, draft, result) in enumerate(zip(call.rows, step.proposals, step.drafts, step.results)):
            seq = call.seqs[i]
            kept_slots = [0] + [1 + a for a in result.accepted]  # the step's input slot and the accepted path
            call.cache.commit(row, kept_slots)
            committed = self.commit(call, seq, result.tokens(draft))
            call.cache.truncate(row, len(seq.tokens) - 1)  # a stop inside the committed tokens drops the rest
            call.feed_proposer(row, seq, committed, step.out, kept_slots)
            if call.constraints is not None:
                call.constraints[i].accept(committed)
            forced = step.forced[row] if step.forced else 0  # the grammar's tokens at the draft's end: their own source
            own, accepted = len(draft) - forced, len(result.accepted)
            call.stats.count_step(proposed.source or "unnamed" if len(proposed) > forced else None, own,
                                  min(accepted, own), len(committed), proposed.drafter_ran)
            if forced:
                call.stats.count_source("grammar", forced, accepted - min(accepted, own))
            if seq.finish_reason is not None:
                finished.append(row)
        self.retire(call, finished)
        if not call.stats.first_token_s and call.stats.new_tokens:
            call.stats.first_token_s = time.perf_counter() - call.start

    def commit(self, call: CallState, seq: SequenceState, tokens: list[int]) -> list[int]:
        """Append verified tokens up to the stop rules (`commit_tokens`) and a stop string; returns those kept."""
        kept, reason = commit_tokens(tokens, len(seq.generated), len(seq.tokens), call.rules)
        cut = stop_cut(self.decode, seq.generated, kept, call.params.stop)
        if cut is not None:
            kept, reason = kept[:cut], "stop"
        seq.tokens += kept
        seq.finish_reason = reason
        return kept

    def retire(self, call: CallState, finished_rows: list[int]) -> None:
        """Finished rows leave the batch; the prefix cache keeps their KV (a one-row cache as it is, others copied
        out)."""
        if not finished_rows:
            return
        if self.prefix_cache is not None:
            for row in finished_rows:
                seq = call.seqs[call.rows[row]]
                cache = call.cache if call.cache.batch_size == 1 else call.cache.row(row)
                self.prefix_cache.store(seq.request_id, seq.tokens, cache,
                                        id(call.proposer) if call.proposer is not None else None)
        keep = [r for r in range(len(call.rows)) if r not in finished_rows]
        if keep:
            call.cache.select_rows(keep)
        call.rows = [call.rows[r] for r in keep]
