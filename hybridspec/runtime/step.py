"""The decode step: what one pass of the target does for every call of a `StepPlan` (the scheduler's).

    steps = [CallStep(p) for p in plan.calls]   # each call's part: its prompt chunk, its rows' draft budgets
    propose(steps, plan.load)        # every row's draft; a proposer drafts all the greedy rows it serves at once
    each(steps, grammar_drafts)      # under a grammar: the part of each draft it allows, its forced tokens, the masks
    route(steps)                     # the part of each draft worth its cost in this pass, planned for all rows at once
    verify(steps)                    # one pass over every row's last token + draft, and the prompt chunks
    each(steps, update)              # commit the accepted tokens (the grammar advances), feed the proposer, retire rows

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

from hybridspec.grammar.constraint import GrammarDraft, apply_mask
from hybridspec.model.inputs import StepInput, StepOutput
from hybridspec.model.target import TargetModel
from hybridspec.proposal import Proposal, speculate_each
from hybridspec.router import Router, StepLoad
from hybridspec.runtime.call import CallState, SequenceState
from hybridspec.runtime.commit import commit_tokens
from hybridspec.runtime.prefill import Prefill
from hybridspec.runtime.prefix_cache import PrefixCache
from hybridspec.runtime.scheduler import CallPlan, StepPlan
from hybridspec.runtime.stats import PassTimes, TokenLogprob
from hybridspec.verifier import VerifyResult, process_logits, verify_batch


@dataclass(eq=False)
class CallStep:
    """One call's part of one step, filled in phase by phase (rows as the call's `rows`)."""

    plan: CallPlan
    proposals: list[Proposal] = field(default_factory=list)  # each row's draft as its proposer made it
    candidates: list[Proposal] = field(default_factory=list)  # ... as its grammar allows it: what the router weighs
    grammar: list[GrammarDraft] | None = None  # each row's draft under its grammar, where one constrains the call
    drafts: list[Proposal] = field(default_factory=list)  # ... as routed: what the pass verifies
    forced: list[int] = field(default_factory=list)  # of each routed draft, how many last tokens the grammar forced
    masks: list[torch.Tensor | None] = field(default_factory=list)  # each row's grammar masks for the pass
    out: StepOutput | None = None
    results: list[VerifyResult] | None = None

    @property
    def call(self) -> CallState:
        return self.plan.call


def each(steps: Sequence[CallStep], work: Callable[[CallStep], Any], timer: str | None = None) -> list[CallStep]:
    """work(step) for every step whose call has not failed; the steps that go on. An exception ends its call alone
    (its caller gets it) and the others go on."""
    going = []
    for step in steps:
        call = step.call
        if call.error is not None:
            continue
        try:
            with call.stats.timed(timer) if timer else contextlib.nullcontext():
                work(step)
        except Exception as e:  # noqa: BLE001 - one call's failure must not end the others'
            call.fail(e)
            continue
        going.append(step)
    return going


def step_input(step: CallStep) -> StepInput:
    """A call's part of the step's pass: its prompt chunk, then (when it decodes) each row's last token and draft."""
    call, chunk = step.call, step.plan.chunk
    if not chunk.decodes:
        return StepInput(call.cache, [], prompt=chunk.tokens, drafter_context=chunk.features)
    return StepInput(call.cache, [call.seqs[i].tokens[-1] for i in call.rows], [d.token_ids for d in step.drafts],
                     [d.parents for d in step.drafts], prompt=chunk.tokens, drafter_context=chunk.features,
                     token_masks=step.masks or None)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under the logits of the position that produced it ([n, V], one row a token), and
    the `top` most probable tokens there."""
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    best = logprobs.topk(top, dim=-1) if top else None
    return [TokenLogprob(t, lp, tuple(zip(best.indices[j].tolist(), best.values[j].tolist())) if best is not None
                         else ()) for j, (t, lp) in enumerate(zip(tokens, chosen))]


class StepRunner:
    """Runs steps (`__call__`) on `target` for an engine's calls: its router, prompts (`Prefill`) and prefix cache
    (where finished rows leave their KV)."""

    def __init__(self, target: TargetModel, router: Router, prefill: Prefill,
                 prefix_cache: PrefixCache | None) -> None:
        self.target, self.router, self.prefill, self.prefix_cache = target, router, prefill, prefix_cache
        self.passes = PassTimes()

    def __call__(self, plan: StepPlan) -> StepLoad | None:
        """Run the step of `plan`; returns its load (what a draft token cost in it), for the next step's plan."""
        steps = [CallStep(p) for p in plan.calls]
        self.propose([s for s in steps if s.plan.decodes], plan.load)
        steps = each(steps, self.grammar_drafts, "propose_s")
        steps, load = self.route(steps, plan.prompt_tokens)
        self.verify(steps)
        each(steps, self.update, "update_s")
        return load

    def propose(self, steps: list[CallStep], load: StepLoad | None) -> None:
        """Each row's draft, within its budget. The greedy calls of one proposer draft together (a drafter's one pass
        for all their rows); a sampling call alone, with its own generator. A proposer's failure ends the calls it
        drafted for."""
        groups: dict[Any, list[CallStep]] = {}
        for step in steps:
            call = step.call
            key = (id(call.proposer), call.resolved.tree) if call.options.greedy else id(call)
            groups.setdefault(key, []).append(step)
        for group in groups.values():
            start = time.perf_counter()
            first = group[0].call
            rows = [(step, i, budget) for step in group for i, budget in zip(step.call.rows, step.plan.budgets)]
            asked = [r for r, (_, _, budget) in enumerate(rows) if first.proposer is not None and budget > 0]
            drafts = [Proposal.empty() for _ in rows]
            try:
                first.set_sampling()  # the proposer may serve other calls' sequences with other settings
                made = speculate_each(first.proposer, [rows[r][0].call.seqs[rows[r][1]].request_id for r in asked],
                                      [rows[r][2] for r in asked], tree=first.resolved.tree, load=load) \
                    if asked else []
                for r, proposal in zip(asked, made):
                    if len(proposal) > rows[r][2]:
                        raise ValueError(f"{type(first.proposer).__name__} proposed {len(proposal)} tokens; at most "
                                         f"{rows[r][2]} were asked for")
                    drafts[r] = proposal
            except Exception as e:  # noqa: BLE001 - the calls of this proposer fail, not the step
                for step in group:
                    step.call.fail(e)
                continue
            for step in group:
                step.proposals = [d for (owner, _, _), d in zip(rows, drafts) if owner is step]
                step.candidates = step.proposals
                step.call.stats.propose_s += time.perf_counter() - start

    def grammar_drafts(self, step: CallStep) -> None:
        """The grammar's work before routing, where one constrains the call: each row's draft as the grammar allows
        it, extended with the tokens it forces (`grammar_drafts`, while speculating), and the masks of the pass over
        it (`Constraint.prepare`); a sampled draft is first redrawn from the drafter's masked distributions (cutting
        it would skew the sample: `Constraint.redraw`)."""
        call, o = step.call, step.call.options
        if not step.plan.decodes or call.constraints is None:
            return
        forced = o.grammar_drafts and call.proposer is not None
        step.grammar = []
        for i, budget, proposal in zip(call.rows, step.plan.budgets, step.proposals):
            constraint = call.constraints[i]
            if not o.greedy and proposal.draft_logits is not None:
                probs_fn = functools.partial(process_logits, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p)
                proposal = constraint.redraw(proposal, probs_fn, call.resolved.generator,
                                             keep_allowed=o.top_k == 0 and o.top_p == 1.0)
                step.grammar.append(constraint.prepare(proposal, budget, forced=False))
            else:
                step.grammar.append(constraint.prepare(proposal, budget, forced))
        step.candidates = [g.proposal for g in step.grammar]

    def route(self, steps: list[CallStep], prompt_tokens: int) -> tuple[list[CallStep], StepLoad | None]:
        """The part of every row's draft worth verifying in this pass, planned by the router for the whole step (by
        the pass's cost over all its rows and prompt tokens), with the grammar's masks of it. A sampled draft is
        verified as drawn: cutting it by its own tokens' probabilities would make the kept tokens no longer follow
        the draft distribution the rejection rule assumes. Returns the steps that go on and the step's load (a
        router's failure ends the calls it routed)."""
        decoding = [s for s in steps if s.plan.decodes]
        if not decoding:
            return steps, None
        candidates = [p for s in decoding for p in s.candidates]
        try:
            route = self.router.plan(candidates, [len(s.call.seqs[i].tokens) for s in decoding for i in s.call.rows],
                                     prompt_tokens)
            if len(route.keep) != len(candidates):
                raise ValueError(f"the router returned {len(route.keep)} proposals for {len(candidates)} sequences")
        except Exception as e:  # noqa: BLE001 - the calls it planned for fail, the rest go on
            for s in decoding:
                s.call.fail(e)
            return [s for s in steps if not s.plan.decodes], None
        keeps = iter(route.keep)
        for s in decoding:
            sampled = not s.call.options.greedy
            keep = [list(range(len(p))) if sampled and p.draft_logits is not None else k
                    for p, k in zip(s.candidates, [next(keeps) for _ in s.candidates])]
            s.drafts = [p.subset(k) for p, k in zip(s.candidates, keep)]
            stats = s.call.stats
            stats.proposals += sum(1 for p in s.candidates if len(p))
            stats.skipped_proposals += sum(1 for p, d in zip(s.candidates, s.drafts) if len(p) and not len(d))
            if s.grammar is not None:
                s.masks = [g.routed(k) for g, k in zip(s.grammar, keep)]
                s.forced = [max(0, g.forced - (len(g.proposal) - len(d))) for g, d in zip(s.grammar, s.drafts)]
        return steps, route.load

    def verify(self, steps: list[CallStep]) -> None:
        """One pass of the target over every call's part (`step_input`), then each call's acceptance rule.
        The pass's time is its calls' prefill when it ran prompt tokens of theirs, else their verification."""
        if not steps:
            return
        inputs = [step_input(s) for s in steps]
        start = time.perf_counter()
        try:
            outs = self.target.step_many(  # a greedy step needs its logits exact only where they may be the maximum
                inputs, return_hidden=any(s.call.wants_target_features for s in steps),
                argmax_only=all(s.call.options.greedy and s.call.options.logprobs is None
                                for s in steps if s.plan.decodes))
        except Exception as e:  # noqa: BLE001 - the pass failed for every call in it
            for step in steps:
                step.call.fail(e)
            return
        elapsed = time.perf_counter() - start
        self.passes.count(elapsed, prompt=any(s.plan.chunk.tokens for s in steps))
        for step, out in zip(steps, outs):
            call, step.out = step.call, out
            self.prefill.gather(call, step.plan.chunk, out)
            if step.plan.chunk.tokens:
                call.stats.prefill_s += elapsed
            else:
                call.stats.verify_s += elapsed
            if step.plan.decodes:
                o = call.options
                with call.stats.timed("verify_s"):
                    for row, (masks, draft) in enumerate(zip(step.masks, step.drafts)):
                        if masks is not None:
                            apply_mask(out.logits[row, :1 + len(draft)], masks)
                    step.results = verify_batch(out.logits, step.drafts, o.temperature, o.top_k, o.top_p,
                                                call.resolved.generator)

    def update(self, step: CallStep) -> None:
        """Commit each row's accepted tokens: the KV cache, the stop rules, the grammar, the proposer, the statistics;
        then retire the rows that finished."""
        call = step.call
        self.prefill.hand_features(call)
        if step.results is None:  # a prompt chunk alone: nothing to commit yet
            return
        self.router.observe(step.drafts, [r.accepted for r in step.results])
        finished = []
        for row, (i, candidate, draft, result) in enumerate(zip(call.rows, step.candidates, step.drafts,
                                                                step.results)):
            seq = call.seqs[i]
            kept_slots = [0] + [1 + a for a in result.accepted]  # the step's input slot and the accepted path
            committed = self.commit(call, seq, result.tokens(draft))
            call.cache.commit(row, kept_slots[:len(committed)])  # a stop inside the tokens drops the rest
            call.feed_proposer(row, seq, committed, step.out, kept_slots)
            if seq.logprobs is not None:
                seq.logprobs += token_logprobs(step.out.logits[row, kept_slots[:len(committed)]], committed,
                                               call.options.logprobs)
            if call.constraints is not None:  # the grammar's work after verification
                call.constraints[i].accept(committed)
            forced = step.forced[row] if step.forced else 0  # the grammar's tokens at the draft's end: their own source
            own, accepted = len(draft) - forced, len(result.accepted)
            call.stats.count_step(candidate.source or "unnamed" if len(candidate) > forced else None, own,
                                  min(accepted, own), len(committed), step.proposals[row].drafter_ran)
            if forced:
                call.stats.count_source("grammar", forced, accepted - min(accepted, own))
            if seq.finish_reason is not None:
                finished.append(row)
        self.retire(call, finished)
        if not call.stats.first_token_s and call.stats.new_tokens:
            call.stats.first_token_s = time.perf_counter() - call.start

    @staticmethod
    def commit(call: CallState, seq: SequenceState, tokens: list[int]) -> list[int]:
        """Append verified tokens up to the stop rules (`commit_tokens`) and a stop string (the sequence's text,
        decoded as they are appended); returns those kept."""
        kept, reason = commit_tokens(tokens, len(seq.generated), len(seq.tokens), call.rules)
        cut = seq.text.add(kept)
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
