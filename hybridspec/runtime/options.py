"""`SamplingOptions`: everything one call asks for, in one frozen object that checks itself when it is made. Every
front end builds one per request (`Engine.generate(prompt, options, **overrides)`, `stream`, `Session.send`, the
server's request bodies through `to_options`), and the engine resolves it against the proposer it names (`resolve`).

An `InvalidParameter` names the option at fault by its name here; the server reports it under the request's own field
name (`hybridspec.serve.protocol.REQUEST_FIELDS`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from hybridspec.errors import InvalidParameter, InvalidParameterType
from hybridspec.grammar.constraint import GrammarSpec, check_tools, checked_grammar_spec
from hybridspec.proposal import FeatureProposer, Proposer
from hybridspec.runtime.proposers import SPECULATE_CHOICES
from hybridspec.verifier.reference import check_sampling_params


@dataclass(frozen=True)
class SamplingOptions:
    """The options of one call, with the Python API's defaults (greedy, 256 new tokens, suffix speculation).

    temperature 0 is greedy; otherwise sampling with top_k (0: off) and top_p. speculate: "suffix" (the engine's
    suffix cache: prompt and past responses), "ngram", a model drafter ("peagle", "fasteagle", "lstm", "eagle3";
    num_speculative_tokens then defaults to the K it was trained for), a hybrid ("suffix+peagle", ...: the suffix
    draft where the text repeats, the drafter's elsewhere), "none", or a `Proposer`. tree=True drafts token trees,
    num_speculative_tokens then counting nodes; None lets the proposer choose (trees for drafters and hybrids, chains
    for the suffix cache). A call stops at EOS (unless ignore_eos: a fixed length, as benchmarks want), at any of
    `stop` (its text is cut before it), or after max_new_tokens.

    Structured output as OpenAI's API defines it: response_format {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"schema": ...}}; tools (function tools, rendered by the chat template) with tool_choice "auto"
    (text, or calls once one starts), "required", a named function or "none", and parallel_tool_calls. Decoding
    follows the grammar exactly as plain constrained decoding would; with grammar_drafts the tokens it forces are
    drafted too (the draft source "grammar"). logprobs: each committed token's log-probability under the target
    (temperature 1; under a grammar, the masked distribution) and the `logprobs` most probable tokens beside it,
    exact whatever was drafted (the verification pass computed them); None: none. compact_json: the JSON of tool
    calls and json_schema replies is written as `json.dumps` writes it (no free whitespace: fewer tokens, all of them
    forced or drafted); False allows any.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    speculate: str | Proposer | FeatureProposer | None = "suffix"
    num_speculative_tokens: int | None = None  # None: the drafter's trained K, else the engine's
    tree: bool | None = None
    stop: str | Sequence[str] | None = None  # kept as a tuple of strings
    seed: int | None = None
    ignore_eos: bool = False
    response_format: Mapping[str, Any] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None  # None: "auto" where tools are given
    parallel_tool_calls: bool = True
    compact_json: bool = True  # JSON under a grammar without free whitespace (False: any, as before)
    grammar_drafts: bool = True
    logprobs: int | None = None  # the committed tokens' log-probabilities and the top `logprobs` (0-20) beside each
    # derived when made: the grammar the output must match, and the tools its text is parsed for (None: no calls)
    grammar: GrammarSpec | None = field(init=False, repr=False, compare=False)
    call_tools: tuple[dict, ...] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _integer(self.max_new_tokens) or not 0 < self.max_new_tokens <= MAX_NEW_TOKENS:
            raise InvalidParameter(f"max_new_tokens must be a positive integer up to {MAX_NEW_TOKENS}, got "
                                   f"{self.max_new_tokens!r}", "max_new_tokens")
        for name in ("temperature", "top_p"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), (int, float)):
                raise InvalidParameter(f"{name} must be a number, got {getattr(self, name)!r}", name)
        if not _integer(self.top_k):
            raise InvalidParameter(f"top_k must be an integer, got {self.top_k!r}", "top_k")
        check_sampling_params(self.temperature, self.top_k, self.top_p)
        if isinstance(self.speculate, str) and self.speculate not in SPECULATE_CHOICES:
            raise InvalidParameter(f"speculate must be one of {SPECULATE_CHOICES} or a Proposer, got "
                                   f"{self.speculate!r}", "speculate")
        k = self.num_speculative_tokens
        if k is not None and (not _integer(k) or k < 0):
            raise InvalidParameter(f"num_speculative_tokens must be an integer >= 0, got {k!r}",
                                   "num_speculative_tokens")
        if self.logprobs is not None and (not _integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidParameter(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {self.logprobs!r}",
                                   "logprobs")
        if self.tree is not None and not isinstance(self.tree, bool):
            raise InvalidParameter(f"tree must be True, False or None, got {self.tree!r}", "tree")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidParameter("stop strings must be non-empty strings", "stop")
        if self.seed is not None and (not _integer(self.seed) or not -2**63 <= self.seed < 2**64):
            raise InvalidParameter(f"seed must be a 64-bit integer, got {self.seed!r}", "seed")
        tools, choice = check_tools(self.tools, self.tool_choice)
        grammar = checked_grammar_spec(self.response_format, tools, choice, bool(self.parallel_tool_calls),
                                       bool(self.compact_json))
        if self.ignore_eos and grammar is not None:
            raise InvalidParameter("ignore_eos cannot be used with response_format or tools: the grammar ends the "
                                   "output with its EOS", "ignore_eos")
        set_field = object.__setattr__  # frozen: the checked forms are set once, here
        set_field(self, "temperature", float(self.temperature))
        set_field(self, "top_p", float(self.top_p))
        set_field(self, "stop", stops)
        set_field(self, "grammar", grammar)
        set_field(self, "call_tools", tuple(tools) if tools and choice != "none" else None)

    def replace(self, **overrides: Any) -> "SamplingOptions":
        """These options with some changed (checked again); a TypeError names any that is no option."""
        unknown = set(overrides) - OPTION_NAMES
        if unknown:
            raise TypeError(f"unexpected arguments: {', '.join(sorted(unknown))} (the options are SamplingOptions' "
                            f"fields: {', '.join(sorted(OPTION_NAMES))})")
        return dataclasses.replace(self, **overrides) if overrides else self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_NEW_TOKENS = 2**31 - 1  # no context is longer; a reply past the context's end stops there ("length")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingOptions) if f.init)
DEFAULT_OPTIONS = SamplingOptions()


def make_options(options: SamplingOptions | None, overrides: Mapping[str, Any],
                 defaults: SamplingOptions = DEFAULT_OPTIONS) -> SamplingOptions:
    """`options` (or `defaults`) with `overrides` applied: what `generate(prompt, options, **overrides)` runs."""
    if options is not None and not isinstance(options, SamplingOptions):
        raise InvalidParameterType(f"options must be a SamplingOptions, got {type(options).__name__} (keyword "
                                   f"arguments override single options)", "options")
    return (options or defaults).replace(**overrides)


@dataclass(frozen=True)
class Resolved:
    """A call's options resolved against the engine: its proposer (None: no speculation), its draft budget, chains or
    trees, and the generator its sampling draws from."""

    proposer: Proposer | FeatureProposer | None
    num_speculative_tokens: int
    tree: bool
    generator: torch.Generator | None


def resolve(options: SamplingOptions, proposer_for: Callable[[Any], Proposer | FeatureProposer | None],
            default_k: int) -> Resolved:
    """The proposer `options.speculate` names (`proposer_for`), the budget (its own, a drafter's trained K, where
    none is given; else the engine's `default_k`) and tree=None resolved by its preference."""
    proposer = proposer_for(options.speculate)
    k = options.num_speculative_tokens
    if k is None:
        k = proposer.num_speculative_tokens if proposer is not None else default_k
    tree = options.tree
    if tree is None:
        tree = proposer is not None and proposer.prefers_trees and proposer.drafts_trees
    elif tree and proposer is not None and not proposer.drafts_trees:
        raise InvalidParameter(f"tree=True needs a proposer that drafts trees, not {type(proposer).__name__} "
                               "(its drafts_trees is False)", "tree")
    generator = torch.Generator().manual_seed(options.seed) if options.seed is not None else None
    return Resolved(proposer, int(k), bool(tree), generator)
