"""The options of one call (`GenerateOptions`, with their defaults) and their validation against the proposer."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

import torch

from hybridspec.errors import InvalidParameter
from hybridspec.grammar.constraint import GrammarSpec, check_tools, grammar_spec
from hybridspec.proposal import FeatureProposer, Proposer
from hybridspec.verifier.reference import check_sampling_params


@dataclass(frozen=True)
class GenerateOptions:
    """The options of one call, with their defaults: `generate`'s keyword arguments (`stream` and `Session.send` take
    the same). See `Engine.generate` for what each means."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    speculate: str | Proposer | FeatureProposer | None = "suffix"
    num_speculative_tokens: int | None = None  # None: the drafter's trained K, else the engine's
    tree: bool | None = None  # None: the proposer's preference (prefers_trees)
    stop: str | Sequence[str] | None = None
    seed: int | None = None
    response_format: Mapping[str, Any] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None  # None: "auto" with tools
    parallel_tool_calls: bool = True
    grammar_drafts: bool = True  # under a grammar, draft the tokens it forces (when speculating)


DEFAULTS = GenerateOptions()


@dataclass
class CallParams:
    """GenerateOptions validated and resolved against the proposer."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    num_speculative_tokens: int
    tree: bool
    stop: tuple[str, ...]
    generator: torch.Generator | None
    grammar: GrammarSpec | None = None  # what the output must match (response_format, tool calls)
    grammar_drafts: bool = True
    tools: list[dict] | None = None  # the call's tools where it may call them (its text is parsed for tool calls)


def resolve_options(options: Mapping[str, Any], proposer_for: Callable[[Any], Proposer | FeatureProposer | None],
                    default_k: int) -> tuple[CallParams, Proposer | FeatureProposer | None]:
    """Validated parameters and the proposer (`proposer_for(speculate)`) from `generate`'s keyword arguments: an
    `InvalidParameter` names a bad one (`.param`), a TypeError unknown ones."""
    unknown = set(options) - {f.name for f in fields(GenerateOptions)}
    if unknown:
        raise TypeError(f"unexpected arguments: {', '.join(sorted(unknown))}")
    o = GenerateOptions(**options)
    if not isinstance(o.max_new_tokens, int) or o.max_new_tokens <= 0:
        raise InvalidParameter(f"max_new_tokens must be a positive integer, got {o.max_new_tokens!r}",
                               "max_new_tokens")
    check_sampling_params(o.temperature, o.top_k, o.top_p)
    proposer = proposer_for(o.speculate)
    k = o.num_speculative_tokens
    if k is None:  # the proposer's own budget (a drafter's: the K it was trained for), else the engine's
        k = proposer.num_speculative_tokens if proposer is not None else default_k
    if not isinstance(k, int) or k < 0:
        raise InvalidParameter(f"num_speculative_tokens must be an integer >= 0, got {k!r}", "num_speculative_tokens")
    stops = (o.stop,) if isinstance(o.stop, str) else tuple(o.stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise InvalidParameter("stop strings must be non-empty strings", "stop")
    if o.seed is not None and not isinstance(o.seed, int):
        raise InvalidParameter(f"seed must be an integer, got {o.seed!r}", "seed")
    generator = torch.Generator().manual_seed(o.seed) if o.seed is not None else None
    tree = o.tree
    if tree is None:
        tree = proposer is not None and proposer.prefers_trees and proposer.drafts_trees
    elif tree and proposer is not None and not proposer.drafts_trees:
        raise InvalidParameter(f"tree=True needs a proposer that drafts trees, not {type(proposer).__name__} "
                               "(its drafts_trees is False)", "tree")
    grammar = grammar_spec(o.response_format, o.tools, o.tool_choice, o.parallel_tool_calls)
    tools, tool_choice = check_tools(o.tools, o.tool_choice)
    params = CallParams(o.max_new_tokens, float(o.temperature), int(o.top_k), float(o.top_p), k, bool(tree), stops,
                        generator, grammar, bool(o.grammar_drafts), tools if tool_choice != "none" else None)
    return params, proposer
