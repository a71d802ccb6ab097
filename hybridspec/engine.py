"""Engine: generation on a target model with speculative decoding, the Python API for agent frameworks.

    engine = Engine.from_pretrained("smollm2")
    result = engine.generate([{"role": "user", "content": "Hi"}], max_new_tokens=64)      # speculate="suffix"
    for delta in engine.stream("Once upon a time", max_new_tokens=32): print(delta, end="")
    session = engine.session(system="You are an agent.")                                     # agent loops
    reply = session.send("ls -la")                  # later turns reuse the KV cache and the suffix cache

Every decode step (`Engine._decode_step`) is propose -> route -> verify -> update, one method each. Outputs are
exact: greedy speculative decoding returns the target's greedy tokens and sampling keeps the target's distribution
(the verifier's rules); speculation only changes how many tokens one forward pass of the target commits.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import numbers
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import torch

from hybridspec.kv_cache import KVCache
from hybridspec.linear import fast_bf16, pack_linears
from hybridspec.prefix_cache import PrefixCache
from hybridspec.proposal import FeatureProposer, Proposal, Proposer, check_proposer
from hybridspec.router import CostGate, FunctionRouter, HybridProposer, Router
from hybridspec.speculators import Drafter, DrafterProposer, TargetFeatures, load_drafter
from hybridspec.speculators.registry import DRAFTER_KINDS
from hybridspec.target import StepOutput, TargetModel
from hybridspec.verifier import VerifyResult, process_logits, verify_batch
from hybridspec.verifier.reference import check_sampling_params

Message = Mapping[str, str]
PromptLike = str | Sequence[int] | Sequence[Message]

HYBRID_KINDS = tuple(f"suffix+{kind}" for kind in DRAFTER_KINDS)
SPECULATE_CHOICES = ("suffix", "ngram", *DRAFTER_KINDS, *HYBRID_KINDS, "none")
KV_HEADROOM_TOKENS = 64  # cache slots past prompt + max_new_tokens: the last step's draft fits without regrowth
# With prefix caching a call's cache is this much larger than the call needs: an agent's next call re-sends the
# conversation plus a few hundred tokens and continues this cache without growing it (growing copies all its KV into
# fresh memory).
KV_SLACK = 0.25
PREFIX_CACHE_BYTES = 2 << 30  # ~46k tokens of SmolLM2-135M's KV in float32 (46 kB per token)
FEATURE_TAIL_TOKENS = 64  # a drafter starting afresh on a cached prompt gets the target's features at this many tokens


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


DEFAULTS = GenerateOptions()


# ----------------------------------------------------------------------------------------------------------------
# results and statistics


@dataclass
class GenerationStats:
    """Counters and wall time of one call (summed over its sequences), or cumulative over many calls."""

    calls: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually run (a session reuses the KV cache of earlier turns)
    new_tokens: int = 0
    steps: int = 0  # verification passes, counted per sequence
    draft_tokens: int = 0  # draft tokens sent to verification
    accepted_tokens: int = 0  # of those, accepted
    proposals: int = 0  # non-empty proposals from the proposer
    skipped_proposals: int = 0  # of those, dropped by the router (not worth a verification pass)
    prefill_s: float = 0.0
    propose_s: float = 0.0  # proposer and router
    verify_s: float = 0.0  # target forward pass and acceptance rule
    update_s: float = 0.0  # KV cache commit, proposer update, stop rules
    total_s: float = 0.0
    first_token_s: float = 0.0  # from the call until its first generated token was committed (time to first token)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def decode_s(self) -> float:
        return self.propose_s + self.verify_s + self.update_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s else 0.0

    def add(self, other: "GenerationStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the wall time of the `with` block to the field `name` (e.g. "verify_s")."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, name, getattr(self, name) + time.perf_counter() - start)

    def as_dict(self) -> dict[str, float]:
        return dict(asdict(self), tokens_per_step=self.tokens_per_step, acceptance=self.acceptance,
                    tokens_per_s=self.tokens_per_s, decode_tokens_per_s=self.decode_tokens_per_s)


@dataclass
class GenerationResult:
    """One sequence's output. token_ids include a final EOS token when generation stopped on one (text does not)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "length"
    prompt_token_ids: list[int]
    stats: GenerationStats  # of the whole call (shared by the results of a batch)


# ----------------------------------------------------------------------------------------------------------------
# one call's state


@dataclass
class _Params:
    """GenerateOptions validated and resolved against the proposer."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    num_speculative_tokens: int
    tree: bool
    stop: tuple[str, ...]
    generator: torch.Generator | None


@dataclass
class _Sequence:
    request_id: Hashable
    tokens: list[int]  # committed: prompt + generated; the cache row holds all but the last
    prompt_len: int
    finish_reason: str | None = None
    extends: Hashable | None = None  # a finished request whose prompt + response this prompt begins with

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass(eq=False)
class _Call:
    """What one generate / stream / send call works on. Cache row r belongs to seqs[live[r]]."""

    seqs: list[_Sequence]
    cache: KVCache
    proposer: Proposer | FeatureProposer | None
    params: _Params
    stats: GenerationStats
    live: list[int]
    started: list[Hashable] = field(default_factory=list)  # request ids started on the proposer
    pending: list[int] | None = None  # uncached prompt tokens left to the first step's pass (Engine._prefill)
    error: Exception | None = None  # what ended the call in a step another thread ran
    start: float = field(default_factory=time.perf_counter)

    @property
    def reads_features(self) -> bool:
        """The proposer reads the target's hidden states (a model drafter, a hybrid)."""
        return self.proposer is not None and self.proposer.wants_target_features


class TurnLock:
    """A reentrant lock granted in arrival order: a thread that releases it and asks again queues behind the threads
    already waiting, so concurrent calls advance a step each in turn (a plain lock lets one call run to its end)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: deque[int] = deque()
        self._owner: int | None = None
        self._depth = 0

    def __enter__(self) -> "TurnLock":
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return self
            self._waiting.append(me)
            while self._owner is not None or self._waiting[0] != me:
                self._cond.wait()
            self._waiting.popleft()
            self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc_info) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()


# ----------------------------------------------------------------------------------------------------------------
# the engine


class Engine:
    """Generates with a `TargetModel`, speculating with a suffix cache, an n-gram proposer, a model drafter (P-EAGLE,
    the LSTM speculator, EAGLE-3) or any `Proposer` / `FeatureProposer` (the contract in `hybridspec.proposal`).

    drafters: checkpoint directories (or `Drafter` modules) for speculate="peagle" | "lstm" | "eagle3"; by default the
    heads shipped for SmolLM2-135M-Instruct. A drafter reads the target's hidden states at the last
    `drafter_context` positions of a prompt, then at every committed token. drafter_bf16: run drafters' matrix
    products in bfloat16 on the CPU (default: where the CPU does bfloat16 natively, where it is the faster).
    router: a `Router` (default: the `CostGate` over `verify_cost`), or a plain function (proposals, contexts) ->
    proposals.
    prefix_cache_bytes: the budget of automatic prefix caching (`hybridspec.prefix_cache`): the KV of recent requests,
    reused by any later call whose prompt begins with the same tokens (None: PREFIX_CACHE_BYTES; 0: off).

    One Engine may serve several threads. A call's prefill runs alone (a single prompt's, with its first step); its
    decode steps join those of the calls that are decoding then (continuous batching): one pass of the target
    verifies every sequence's draft.
    """

    # A single prompt's uncached tokens run in its first step's pass (see _prefill); False: in a pass of their own.
    fuse_prefill_with_first_step = True

    def __init__(self, target: TargetModel, tokenizer, *, verify_cost: Any = None,
                 router: Router | Callable[[Sequence[Proposal], Sequence[int]], list[Proposal]] | None = None,
                 suffix_cache=None, num_speculative_tokens: int = 16,
                 drafters: Mapping[str, str | os.PathLike | Any] | None = None, drafter_context: int = 1024,
                 drafter_bf16: bool | None = None, prefix_cache_bytes: int | None = None):
        self.target = target
        self.tokenizer = tokenizer
        if router is None:
            router = CostGate(verify_cost)
        self.router: Router = router if isinstance(router, Router) else FunctionRouter(router)
        self.num_speculative_tokens = num_speculative_tokens
        self._suffix_cache = suffix_cache
        self._ngram = None
        unknown = set(drafters or ()) - set(DRAFTER_KINDS)
        if unknown:
            raise ValueError(f"drafters: unknown kind(s) {sorted(unknown)}; the kinds are {DRAFTER_KINDS}")
        self.drafters: dict[str, Any] = dict(drafters or {})
        self.drafter_context = drafter_context
        self.drafter_bf16 = fast_bf16() if drafter_bf16 is None else drafter_bf16
        self._drafter_proposers: dict[str, DrafterProposer] = {}
        self._hybrids: dict[str, HybridProposer] = {}
        self._request_ids = itertools.count()
        self.eos_token_ids = self._eos_ids()
        self.stats = GenerationStats()  # cumulative over every call
        budget = PREFIX_CACHE_BYTES if prefix_cache_bytes is None else prefix_cache_bytes
        self.prefix_cache: PrefixCache | None = PrefixCache(budget) if budget > 0 else None
        self._lock = TurnLock()  # every step of every call runs under it
        self._waiting: list[_Call] = []  # calls whose thread waits for their next decode step
        self._waiting_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike = "smollm2", dtype: torch.dtype = torch.float32,
                        max_seq_len: int | None = None, **kwargs) -> "Engine":
        """An engine on "smollm2" (the embedded model, converted on first use) or a local Hugging Face directory."""
        from hybridspec.models import load_tokenizer

        return cls(TargetModel.from_pretrained(name_or_path, dtype=dtype, max_seq_len=max_seq_len),
                   load_tokenizer(name_or_path), **kwargs)

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        for source in (getattr(self.target.model, "generation_config", None), self.target.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            ids.update([value] if isinstance(value, int) else value or [])
        return frozenset(ids)

    # ------------------------------------------------------------------------------------------------ proposers

    @property
    def suffix_cache(self):
        """The engine's suffix cache: prompts of live requests and every finished response (shared by all calls)."""
        if self._suffix_cache is None:
            from hybridspec.suffix import SuffixCache

            self._suffix_cache = SuffixCache(num_speculative_tokens=self.num_speculative_tokens,
                                             vocab_size=self.target.vocab_size)
        return self._suffix_cache

    def save_cache(self, path: str | os.PathLike) -> None:
        """Save the suffix cache's global tree (past responses), e.g. between runs of an agent."""
        self.suffix_cache.save(path)

    def load_cache(self, path: str | os.PathLike) -> None:
        self.suffix_cache.load(path)

    def drafter_proposer(self, kind: str) -> DrafterProposer:
        """The engine's `DrafterProposer` for a drafter kind, loaded on first use and checked against the target."""
        if kind not in self._drafter_proposers:
            source = self.drafters.get(kind, Path(__file__).resolve().parents[1] / "speculators" / "checkpoints"
                                       / f"{kind}-smollm2")
            if isinstance(source, Drafter):
                source.check_target(self.target.config, self.target.aux_layer_ids)
                drafter = copy.deepcopy(source).to(self.target.device).eval()  # packing below must not touch theirs
            else:
                try:
                    drafter = load_drafter(source, target=self.target.config, embed_tokens=self.target.embed,
                                           aux_layer_ids=self.target.aux_layer_ids, device=self.target.device)
                except ValueError as e:
                    hint = "" if kind in self.drafters else (
                        f" (the shipped {kind} head is for SmolLM2-135M-Instruct: train one for this target with "
                        f"`hybridspec train` and pass Engine(..., drafters={{{kind!r}: PATH}}))")
                    raise ValueError(f"{e}{hint}") from e
            if self.target.device.type == "cpu":
                # A drafter's numbers only choose what to verify, never what is output: bfloat16 is lossless here.
                pack_linears(drafter, torch.bfloat16 if self.drafter_bf16 else None)
            self._drafter_proposers[kind] = DrafterProposer(drafter)
        return self._drafter_proposers[kind]

    def _proposer(self, speculate: str | Proposer | FeatureProposer | None) -> Proposer | FeatureProposer | None:
        if speculate is None or speculate == "none":
            return None
        if speculate == "suffix":
            return self.suffix_cache
        if speculate in DRAFTER_KINDS:
            return self.drafter_proposer(speculate)
        if speculate in HYBRID_KINDS:
            if speculate not in self._hybrids:
                # a calibrated expectation picks between the two drafts, when the router is the cost gate
                expected = self.router.expected_tokens if isinstance(self.router, CostGate) else None
                self._hybrids[speculate] = HybridProposer(
                    self.suffix_cache, self.drafter_proposer(speculate.split("+")[1]),
                    num_speculative_tokens=self.num_speculative_tokens, expected=expected)
            return self._hybrids[speculate]
        if speculate == "ngram":
            if self._ngram is None:
                from hybridspec.suffix import NgramProposer

                self._ngram = NgramProposer(num_speculative_tokens=self.num_speculative_tokens)
            return self._ngram
        if isinstance(speculate, str):
            raise ValueError(f"speculate must be one of {SPECULATE_CHOICES} or a Proposer, got {speculate!r}")
        return check_proposer(speculate)

    # ------------------------------------------------------------------------------------------------ input

    def encode(self, prompt: PromptLike) -> list[int]:
        """Token ids of a prompt: text as is, chat messages through the tokenizer's chat template, or token ids."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif len(prompt) and all(isinstance(m, Mapping) for m in prompt):
            ids = self.tokenizer.apply_chat_template(list(prompt), tokenize=True, add_generation_prompt=True,
                                                     return_dict=False)
        elif all(isinstance(t, numbers.Integral) or (isinstance(t, torch.Tensor) and t.dim() == 0) for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is out of the vocabulary [0, {self.target.vocab_size})")
        else:
            raise TypeError("a prompt is a string, a list of chat messages ({'role', 'content'}) or a list of token "
                            "ids")
        ids = list(ids)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.target.max_seq_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {self.target.max_seq_len} "
                             f"(at least one token must remain to generate)")
        return ids

    @staticmethod
    def _is_batch(prompt_or_prompts: Any) -> bool:
        if isinstance(prompt_or_prompts, (str, torch.Tensor)) or not isinstance(prompt_or_prompts, Sequence):
            return False
        return len(prompt_or_prompts) > 0 and all(
            isinstance(p, str) or (isinstance(p, Sequence) and not isinstance(p, Mapping)) for p in prompt_or_prompts)

    def _options(self, options: Mapping[str, Any]) -> tuple[_Params, Proposer | FeatureProposer | None]:
        """Validated generation parameters and the proposer, from `generate`'s keyword arguments."""
        unknown = set(options) - {f.name for f in fields(GenerateOptions)}
        if unknown:
            raise TypeError(f"unexpected arguments: {', '.join(sorted(unknown))}")
        o = GenerateOptions(**options)
        if not isinstance(o.max_new_tokens, int) or o.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {o.max_new_tokens!r}")
        check_sampling_params(o.temperature, o.top_k, o.top_p)
        proposer = self._proposer(o.speculate)
        k = o.num_speculative_tokens
        if k is None:  # the proposer's own budget (a drafter's: the K it was trained for), else the engine's
            k = proposer.num_speculative_tokens if proposer is not None else self.num_speculative_tokens
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {k!r}")
        stops = (o.stop,) if isinstance(o.stop, str) else tuple(o.stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        generator = torch.Generator().manual_seed(o.seed) if o.seed is not None else None
        tree = o.tree
        if tree is None:
            tree = proposer is not None and proposer.prefers_trees and proposer.drafts_trees
        elif tree and proposer is not None and not proposer.drafts_trees:
            raise ValueError(f"tree=True needs a proposer that drafts trees, not {type(proposer).__name__} "
                             "(its drafts_trees is False)")
        params = _Params(o.max_new_tokens, float(o.temperature), int(o.top_k), float(o.top_p), k, bool(tree), stops,
                         generator)
        return params, proposer

    # ------------------------------------------------------------------------------------------------ public API

    def generate(self, prompt_or_messages: PromptLike | Sequence[PromptLike],
                 max_new_tokens: int = DEFAULTS.max_new_tokens, temperature: float = DEFAULTS.temperature,
                 top_p: float = DEFAULTS.top_p, top_k: int = DEFAULTS.top_k,
                 speculate: str | Proposer | FeatureProposer | None = DEFAULTS.speculate,
                 num_speculative_tokens: int | None = DEFAULTS.num_speculative_tokens,
                 tree: bool | None = DEFAULTS.tree, stop: str | Sequence[str] | None = DEFAULTS.stop,
                 seed: int | None = DEFAULTS.seed) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (text, chat messages or token ids), or a list of prompts as one batch.

        temperature 0 is greedy; otherwise sampling with top_k / top_p. speculate: "suffix" (the engine's suffix
        cache: prompt and past responses), "ngram", a model drafter ("peagle", "lstm", "eagle3"; num_speculative_tokens
        then defaults to the K it was trained for), a hybrid ("suffix+peagle", ...: the suffix draft where the text
        repeats, the drafter's elsewhere), "none", or a Proposer. tree=True drafts token trees: the suffix cache's, or a
        drafter's greedy chain with its runner-up tokens as siblings; num_speculative_tokens then counts tree nodes.
        tree=None (default) lets the proposer choose: trees for drafters and hybrids, chains for the suffix cache
        (the faster on a CPU, where verifying many tokens costs more than a plain step).
        Stops at EOS, at any of `stop` (the text is cut before it), or after max_new_tokens.
        """
        batch = self._is_batch(prompt_or_messages)
        call = self._start_call(list(prompt_or_messages) if batch else [prompt_or_messages], dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, speculate=speculate,
            num_speculative_tokens=num_speculative_tokens, tree=tree, stop=stop, seed=seed))
        for _ in self._steps(call):
            pass
        results = self._results(call)
        return results if batch else results[0]

    def stream(self, prompt_or_messages: PromptLike, **options) -> Iterator[str]:
        """Generate for one prompt, yielding text deltas as tokens are committed (keyword arguments of `generate`)."""
        call = self._start_call([prompt_or_messages], options)
        seq, sent = call.seqs[0], ""
        for _ in self._steps(call):
            text = self._text(seq, call.params.stop)
            if seq.finish_reason is None and text.endswith("\ufffd"):
                continue  # an incomplete UTF-8 character: wait for the rest of its bytes
            if len(text) > len(sent):
                yield text[len(sent):]
                sent = text

    def session(self, system: str | None = None, **defaults) -> "Session":
        """A multi-turn conversation that keeps its KV cache and feeds the suffix cache turn after turn.

        `defaults` are `generate` arguments used for every turn (e.g. speculate="suffix", max_new_tokens=256)."""
        return Session(self, system=system, **defaults)

    # ------------------------------------------------------------------------------------------------ the loop

    def _start_call(self, prompts: Sequence[PromptLike], options: Mapping[str, Any]) -> _Call:
        """A call's validated options, proposer and sequences (one per prompt), on a cache that holds the longest
        prefix of each prompt the prefix cache has."""
        with self._lock:  # proposers load lazily; the prefix cache is shared
            params, proposer = self._options(options)
            seqs = []
            for prompt in prompts:
                ids = self.encode(prompt)
                seqs.append(_Sequence(request_id=f"hs-{next(self._request_ids)}", tokens=ids, prompt_len=len(ids)))
            need = min(max(len(s.tokens) for s in seqs) + params.max_new_tokens + KV_HEADROOM_TOKENS,
                       self.target.max_seq_len)
            cache = self._cache_for(seqs, need, proposer)
        return _Call(seqs, cache, proposer, params, GenerationStats(), live=list(range(len(seqs))))

    def _cache_for(self, seqs: list[_Sequence], need: int, proposer: Proposer | FeatureProposer | None) -> KVCache:
        """A cache of at least `need` slots whose row r holds the KV of the longest cached prefix of seqs[r]'s prompt;
        sets each sequence's `extends`. A single prompt that continues most of an entry takes that entry's cache (no
        copy unless it must grow)."""
        capacity = need if self.prefix_cache is None else min(need + int(need * KV_SLACK), self.target.max_seq_len)
        owner = id(proposer) if proposer is not None else None
        matches = [self.prefix_cache.match(seq.tokens, owner) if self.prefix_cache is not None else None
                   for seq in seqs]
        for seq, m in zip(seqs, matches):
            seq.extends = m.extends if m is not None else None
            if m is None or proposer is None or not proposer.wants_target_features:
                continue
            if m.extends is not None and m.length >= m.extends_length - 1:
                m.length = m.extends_length - 1  # the drafter continues the extended request's state from here
            else:  # a drafter starting afresh reads the target's features at the prompt's tail
                m.length = max(0, min(m.length, len(seq.tokens) - 1 - FEATURE_TAIL_TOKENS))
        m = matches[0]
        if len(seqs) == 1 and m is not None and m.length and 2 * m.length >= m.cache.lengths[0]:
            cache = self.prefix_cache.take(m)
            cache.truncate(0, m.length)
            if cache.capacity < need:
                cache.reserve(capacity, exact=True)
            return cache
        cache = self.target.new_cache(len(seqs), capacity=capacity)
        for row, m in enumerate(matches):
            if m is not None and m.length:
                cache.copy_prefix(row, m.cache, 0, m.length)
        return cache

    def _steps(self, call: _Call) -> Iterator[None]:
        """Run a call: prefill, start its requests on the proposer, then decode steps until every sequence finished;
        yields after each step. Calls from other threads share the decode steps (continuous batching): a step runs
        every call that is waiting for one, in one pass of the target."""
        call.start = time.perf_counter()
        try:
            with self._lock:
                self._begin(call)
            while call.live:
                self._join_step(call)
                if call.error is not None:
                    raise call.error
                yield
        finally:  # also when a caller abandons its stream: its requests are aborted
            with self._lock:
                self._end(call)

    def _begin(self, call: _Call) -> None:
        """Prefill every prompt past its cached prefix and start each sequence on the proposer as one request (which
        continues the earlier request it extends)."""
        features = self._prefill(call)
        if call.proposer is None:
            return
        self._set_sampling(call)
        for seq, feats in zip(call.seqs, features):
            if call.reads_features:
                call.proposer.start_request(seq.request_id, list(seq.tokens), features=feats, extends=seq.extends)
            else:
                call.proposer.start_request(seq.request_id, list(seq.tokens), extends=seq.extends)
            call.started.append(seq.request_id)

    def _join_step(self, call: _Call) -> None:
        """Wait for the next decode step of `call`: run it, together with every call waiting then, or find that
        another thread ran it."""
        with self._waiting_lock:
            self._waiting.append(call)
        with self._lock:
            with self._waiting_lock:
                batch = self._waiting if any(c is call for c in self._waiting) else []
                if batch:
                    self._waiting = []
            if batch:
                self._decode_step(batch)

    def _end(self, call: _Call) -> None:
        done = all(s.finish_reason is not None for s in call.seqs)
        for rid in call.started:
            (call.proposer.finish_request if done else call.proposer.abort_request)(rid)
        call.started = []
        call.stats.calls += 1
        call.stats.total_s += time.perf_counter() - call.start
        self.stats.add(call.stats)

    def _prefill(self, call: _Call) -> list[TargetFeatures | None]:
        """Run each prompt's uncached tokens (all but its last, the first step's input) into the cache; returns the
        target's features at the prompt's last positions when the proposer reads them.

        A single prompt whose proposer reads no features leaves them to its first step instead: that pass runs them,
        the last token and a chain draft causally in one (`TargetModel.prefill_and_step`), reading the weights once
        rather than twice."""
        with call.stats.timed("prefill_s"):
            todo = [seq.tokens[call.cache.lengths[row]:-1] for row, seq in enumerate(call.seqs)]
            features: list[TargetFeatures | None] = [None] * len(call.seqs)
            if len(todo) == 1 and todo[0] and not call.reads_features and self.fuse_prefill_with_first_step:
                call.pending = todo[0]
            elif any(todo):
                out = self.target.prefill(call.cache, todo, hidden_tail=self.drafter_context if call.reads_features
                                          else 0)
                if call.reads_features:
                    features = [TargetFeatures(aux, final) for aux, final in out.hidden_tail]
            elif call.reads_features:  # the prompt's KV is all cached: the drafter goes on as it was (extends)
                features = [TargetFeatures(self._no_hidden(len(self.target.aux_layer_ids)), self._no_hidden(1))
                            for _ in call.seqs]
            call.stats.prompt_tokens += sum(seq.prompt_len for seq in call.seqs)
            call.stats.prefill_tokens += sum(len(t) for t in todo)
        return features

    def _no_hidden(self, layers: int) -> torch.Tensor:
        return torch.zeros(0, layers * self.target.hidden_size, device=self.target.device)

    @staticmethod
    def _set_sampling(call: _Call) -> None:
        """A proposer that reads features drafts from the distribution the verifier will use."""
        if call.reads_features:
            p = call.params
            call.proposer.set_sampling(None if p.temperature == 0 else functools.partial(
                process_logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p), p.generator)

    def _decode_step(self, calls: list[_Call]) -> None:
        """One decode step of every live sequence of `calls`: propose -> route -> verify (one pass of the target over
        all of them) -> update. A call whose proposer or update fails gets the error (its thread raises it); the
        others go on."""
        routed: dict[int, list[Proposal]] = {}
        for call in calls:
            with call.stats.timed("propose_s"), self._failing(call):
                self._set_sampling(call)  # the proposer may serve other calls' sequences with other settings
                routed[id(call)] = self._route(call, self._propose(call))
        calls = [c for c in calls if c.error is None]
        if not calls:
            return
        start = time.perf_counter()
        prefill_s = {id(c): c.stats.prefill_s for c in calls}
        try:
            verified = self._verify(calls, [routed[id(c)] for c in calls])
        except Exception as e:
            for call in calls:
                call.error, call.live = e, []
            return
        elapsed = time.perf_counter() - start
        for call, (out, results) in zip(calls, verified):
            call.stats.verify_s += elapsed - (call.stats.prefill_s - prefill_s[id(call)])  # a deferred prefill's time
            # counts as prefill
            with call.stats.timed("update_s"), self._failing(call):
                self._update(call, routed[id(call)], out, results)
            if not call.stats.first_token_s and call.stats.new_tokens:
                call.stats.first_token_s = time.perf_counter() - call.start

    @staticmethod
    @contextlib.contextmanager
    def _failing(call: _Call) -> Iterator[None]:
        """An exception in the block ends `call` with that error instead of propagating to the step's other calls."""
        try:
            yield
        except Exception as e:
            call.error, call.live = e, []

    def _propose(self, call: _Call) -> list[Proposal]:
        """Each live sequence's draft: no longer than the budget, the context left, or the tokens still wanted."""
        proposals = []
        for i in call.live:
            seq = call.seqs[i]
            budget = min(call.params.num_speculative_tokens, self.target.max_seq_len - len(seq.tokens),
                         call.params.max_new_tokens - len(seq.generated) - 1)
            if call.proposer is None or budget <= 0:
                proposals.append(Proposal.empty())
                continue
            proposal = call.proposer.speculate(seq.request_id, budget, tree=call.params.tree)
            if len(proposal) > budget:
                raise ValueError(f"{type(call.proposer).__name__} proposed {len(proposal)} tokens; at most {budget} "
                                 f"were asked for")
            proposals.append(proposal)
        return proposals

    def _route(self, call: _Call, proposals: list[Proposal]) -> list[Proposal]:
        """The part of each draft worth a verification pass (the router's cost gate)."""
        routed = self.router(proposals, [len(call.seqs[i].tokens) for i in call.live])
        if call.params.temperature > 0:
            # A sampled draft is verified as drawn: cutting it by its own tokens' probabilities would make the kept
            # tokens no longer follow the draft distribution the rejection rule assumes, and bias the output.
            routed = [p if p.draft_logits is not None else r for p, r in zip(proposals, routed)]
        call.stats.proposals += sum(1 for p in proposals if len(p))
        call.stats.skipped_proposals += sum(1 for p, r in zip(proposals, routed) if len(p) and not len(r))
        return routed

    def _verify(self, calls: list[_Call], routed: list[list[Proposal]]) -> list[tuple[StepOutput, list[VerifyResult]]]:
        """One pass of the target over [last token] + draft for every live sequence of every call (a call with a
        deferred prefill: its own pass, see _prefill), then each call's acceptance rule.

        Greedy: a draft token is kept while it equals the target's argmax; sampling: x is kept with probability
        min(1, p_target(x) / p_draft(x)), else the target resamples from norm(max(0, p_target - p_draft))."""
        outs: dict[int, StepOutput] = {}
        for call, (proposal,) in ((c, rs) for c, rs in zip(calls, routed) if c.pending is not None):
            pending, call.pending = call.pending, None
            with call.stats.timed("prefill_s"):
                if proposal.is_chain:  # one causal pass
                    outs[id(call)] = self.target.prefill_and_step(
                        call.cache, pending, call.seqs[0].tokens[-1], proposal.token_ids,
                        argmax_only=call.params.temperature == 0)
                else:  # a tree attends by its own mask: the prompt first, the tree with the others
                    self.target.prefill(call.cache, [pending])
        stepped = [(c, rs) for c, rs in zip(calls, routed) if id(c) not in outs]
        if stepped:
            step_outs = self.target.step_many(
                [(c.cache, [c.seqs[i].tokens[-1] for i in c.live], [r.token_ids for r in rs], [r.parents for r in rs])
                 for c, rs in stepped], return_hidden=any(c.reads_features for c, _ in stepped),
                argmax_only=all(c.params.temperature == 0 for c, _ in stepped))
            outs.update((id(c), out) for (c, _), out in zip(stepped, step_outs))
        return [(outs[id(c)], verify_batch(outs[id(c)].logits, rs, c.params.temperature, c.params.top_k,
                                           c.params.top_p, c.params.generator)) for c, rs in zip(calls, routed)]

    def _update(self, call: _Call, routed: list[Proposal], out: StepOutput, results: list[VerifyResult]) -> None:
        """Commit each sequence's accepted tokens: the KV cache, the stop rules, the proposer, the statistics; then
        retire the sequences that finished."""
        self.router.observe(routed, [r.accepted for r in results])
        finished = []
        for row, (i, proposal, result) in enumerate(zip(call.live, routed, results)):
            seq = call.seqs[i]
            kept_slots = self._commit_kv(call.cache, row, result.accepted)
            committed = self._commit(seq, result.tokens(proposal), call.params)
            call.cache.truncate(row, len(seq.tokens) - 1)  # a stop inside the committed tokens drops the rest
            self._feed_proposer(call, row, seq, committed, out, kept_slots)
            self._count_step(call.stats, proposal, result, committed)
            if seq.finish_reason is not None:
                finished.append(row)
        self._retire(call, finished)

    @staticmethod
    def _commit_kv(cache: KVCache, row: int, accepted: list[int]) -> list[int]:
        """Keep the KV of the step's input slot (the last token) and of the accepted path; returns those slots."""
        kept_slots = [0] + [1 + a for a in accepted]
        cache.commit(row, kept_slots)
        return kept_slots

    @staticmethod
    def _feed_proposer(call: _Call, row: int, seq: _Sequence, committed: list[int], out: StepOutput,
                       kept_slots: list[int]) -> None:
        """Tell the proposer the committed tokens (a drafter also gets the target's features at the slots that
        produced them)."""
        if call.proposer is None:
            return
        if call.reads_features:
            slots = torch.tensor(kept_slots[:len(committed)], device=out.logits.device)
            call.proposer.append(seq.request_id, committed, features=TargetFeatures(
                out.aux_hidden[row, slots], out.final_hidden[row, slots]))
        else:
            call.proposer.append(seq.request_id, committed)

    @staticmethod
    def _count_step(stats: GenerationStats, proposal: Proposal, result: VerifyResult, committed: list[int]) -> None:
        stats.steps += 1
        stats.new_tokens += len(committed)
        stats.draft_tokens += len(proposal)
        stats.accepted_tokens += len(result.accepted)

    def _retire(self, call: _Call, finished_rows: list[int]) -> None:
        """Finished sequences leave the batch; the prefix cache keeps their KV (a one-row cache as it is, others
        copied out)."""
        if not finished_rows:
            return
        if self.prefix_cache is not None:
            for row in finished_rows:
                seq = call.seqs[call.live[row]]
                cache = call.cache if call.cache.batch_size == 1 else call.cache.row(row)
                self.prefix_cache.store(seq.request_id, seq.tokens, cache,
                                        id(call.proposer) if call.proposer is not None else None)
        if len(finished_rows) == len(call.live):
            call.live = []
            return
        keep = [r for r in range(len(call.live)) if r not in finished_rows]
        call.cache.select_rows(keep)
        call.live = [call.live[r] for r in keep]

    def _commit(self, seq: _Sequence, tokens: list[int], params: _Params) -> list[int]:
        """Append verified tokens, stopping at EOS, max_new_tokens, the context's end or a stop string; returns the
        tokens kept. The cut depends only on the token stream, not on how many tokens a step committed, so
        speculative and plain decoding stop at the same token."""
        kept, reason = [], None
        for token in tokens:
            kept.append(token)
            if token in self.eos_token_ids:
                reason = "eos"
            elif (len(seq.generated) + len(kept) >= params.max_new_tokens
                  or len(seq.tokens) + len(kept) >= self.target.max_seq_len):
                reason = "length"
            if reason is not None:
                break
        if params.stop:
            cut = self._stop_cut(seq.generated, kept, params.stop)
            if cut is not None:
                kept, reason = kept[:cut], "stop"
        seq.tokens += kept
        seq.finish_reason = reason
        return kept

    def _stop_cut(self, generated: list[int], new: list[int], stops: tuple[str, ...]) -> int | None:
        """How many of `new` tokens it takes for the text to contain a stop string, or None if all of them do not."""
        decode = self.tokenizer.decode
        if not any(s in decode(generated + new, skip_special_tokens=True) for s in stops):
            return None
        for j in range(1, len(new) + 1):  # rare: only on the step that completes a stop string
            text = decode(generated + new[:j], skip_special_tokens=True)
            if any(s in text for s in stops):
                return j
        return len(new)

    def _text(self, seq: _Sequence, stops: tuple[str, ...]) -> str:
        text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        if seq.finish_reason == "stop":
            cut = [i for i in (text.find(s) for s in stops) if i >= 0]
            text = text[:min(cut)] if cut else text
        return text

    def _results(self, call: _Call) -> list[GenerationResult]:
        return [GenerationResult(text=self._text(s, call.params.stop), token_ids=s.generated,
                                 finish_reason=s.finish_reason, prompt_token_ids=s.tokens[:s.prompt_len],
                                 stats=call.stats) for s in call.seqs]


class Session:
    """An agent loop's conversation: each `send` appends messages, generates the assistant's reply and keeps it.

    The conversation's exact token ids are kept across turns: a turn appends only the chat template's text that
    follows the previous reply (its end tag, the new messages, the generation prompt), tokenised on its own, so the
    prompt extends the previous turn's prompt + reply token for token: the prefix cache holds its KV (only the new
    tokens run) and the suffix cache continues the previous turn's request (only new tokens are indexed).
    """

    _REPLY = "\x00hybridspec-reply\x00"  # stands for the previous reply when rendering what follows it

    def __init__(self, engine: Engine, system: str | None = None, **defaults):
        self.engine = engine
        self.defaults = dict(defaults)
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.tokens: list[int] = []  # the conversation so far, as the model saw and wrote it
        self.stats = GenerationStats()

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_tokens(self, new_messages: Sequence[Message]) -> list[int]:
        """The prompt `send(new_messages)` would run: the conversation's tokens + the template's text after the
        previous reply, for the new messages."""
        new_messages = [dict(m) for m in new_messages]
        tokenizer = self.engine.tokenizer
        if self.tokens:
            full = self._render(self.messages[:-1] + [{"role": "assistant", "content": self._REPLY}] + new_messages)
            parts = full.split(self._REPLY)
            if len(parts) == 2:
                after = parts[1]
                if self.tokens[-1] in self.engine.eos_token_ids:  # the reply's EOS is the template's end tag
                    end_tag = tokenizer.decode(self.tokens[-1:])
                    after = after[len(end_tag):] if after.startswith(end_tag) else after
                return self.tokens + tokenizer.encode(after, add_special_tokens=False)
        # first turn, or a template that does not render the reply verbatim: tokenise the whole conversation
        return tokenizer.encode(self._render(self.messages + new_messages), add_special_tokens=False)

    def send(self, message: str | Message | Sequence[Message], **kwargs) -> GenerationResult:
        """Add a user message (a string), a message dict (any role, e.g. a tool observation) or several, and reply."""
        if isinstance(message, str):
            new = [{"role": "user", "content": message}]
        elif isinstance(message, Mapping):
            new = [dict(message)]
        else:
            new = [dict(m) for m in message]
        if not new or any(not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str) for m in new):
            raise ValueError("messages need a string 'role' and 'content'")
        call = self.engine._start_call([self.prompt_tokens(new)], {**self.defaults, **kwargs})
        for _ in self.engine._steps(call):
            pass
        result = self.engine._results(call)[0]
        seq = call.seqs[0]
        # The reply stays in the conversation as the model wrote it (up to the stop string's end, if any).
        self.tokens = seq.tokens
        self.messages += new + [{"role": "assistant",
                                 "content": self.engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)}]
        self.stats.add(call.stats)
        return result
