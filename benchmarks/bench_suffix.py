"""Suffix proposer benchmark: hybridspec's SuffixCache against ArcticInference's SuffixDecodingCache and n-gram lookup.

Each proposer is driven as vLLM drives the peer: a request starts with its prompt; every step speculates, then appends
the accepted draft tokens plus one bonus token, with oracle acceptance against the request's true continuation;
finished responses enter the global cache. All proposers see the same requests, interleaved request by request so that
noise on a shared machine falls on all of them alike. Agent turns pass `extends=` (the previous turn): hybridspec and
n-gram then index only the new tokens, while the peer, which has no session API, indexes each prompt in full; this
is what prompt_index_ms_per_1k (time to start a request, per 1k prompt tokens) shows on the agent workload.
us_per_append_token counts finish_request too: the peer indexes a response globally while appending it, we do it when
the request finishes.

    python benchmarks/bench_suffix.py --json out/bench_suffix.json      # all three under .venv-peers/bin/python

Under an environment without arctic-inference the `arctic-suffix` proposer is skipped with a note
(scripts/setup_peers.sh creates .venv-peers, where all three run).
"""
from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
from tqdm import tqdm

from common import machine_info, write_json
from hybridspec.agent_traces.replay import Recorder, replay_call

VOCAB_SIZE = 49152  # SmolLM2's


# ---------------------------------------------------------------- workloads

@dataclass
class Request:
    request_id: str
    prompt: np.ndarray
    response: np.ndarray
    extends: str | None = None  # the previous turn of the same session, whose prompt + response the prompt extends


class TokenSource:
    """Token ids with a Zipf-like frequency distribution over a shuffled vocabulary, as in natural text and code."""

    def __init__(self, rng: np.random.Generator, ids: np.ndarray, exponent: float = 1.1):
        self.rng = rng
        self.ids = ids
        p = 1.0 / (np.arange(len(ids)) + 2.7) ** exponent
        self.cdf = np.cumsum(p / p.sum())

    def sample(self, n: int) -> np.ndarray:
        idx = np.minimum(np.searchsorted(self.cdf, self.rng.random(n)), len(self.ids) - 1)
        return self.ids[idx].astype(np.int32)


class CodeWriter:
    """Random code files as token "lines": indentation, keywords/punctuation and a file's own identifiers, newline."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        ids = rng.permutation(VOCAB_SIZE).astype(np.int32)
        self.newline, self.indent = int(ids[0]), int(ids[1])
        self.syntax = TokenSource(rng, ids[2:120], exponent=1.0)  # keywords, operators, brackets
        self.identifier_pool = ids[120:]

    def new_file(self, n_tokens: int) -> list[np.ndarray]:
        idents = TokenSource(self.rng, self.rng.choice(self.identifier_pool, 400, replace=False))
        lines, total, depth = [], 0, 0
        while total < n_tokens:
            line = self._line(idents, depth)
            lines.append(line)
            total += len(line)
            depth = int(np.clip(depth + self.rng.choice([-1, 0, 0, 0, 1]), 0, 5))
        return lines

    def edit(self, lines: list[np.ndarray], n_edits: int) -> list[np.ndarray]:
        """A new version with small edits: lines rewritten, tokens changed, lines inserted or deleted."""
        lines = list(lines)
        idents = TokenSource(self.rng, np.unique(np.concatenate(lines)))
        for _ in range(n_edits):
            i = int(self.rng.integers(len(lines)))
            depth = int(np.sum(lines[i] == self.indent))
            kind = self.rng.integers(4)
            if kind == 0:
                lines[i] = self._line(idents, depth)
            elif kind == 1:
                line = lines[i].copy()
                j = int(self.rng.integers(depth, len(line) - 1)) if len(line) - 1 > depth else depth
                line[j] = idents.sample(1)[0]
                lines[i] = line
            elif kind == 2:
                lines.insert(i, self._line(idents, depth))
            elif len(lines) > 1:
                del lines[i]
        return lines

    def _line(self, idents: TokenSource, depth: int) -> np.ndarray:
        n = int(self.rng.integers(3, 13))
        body = np.where(self.rng.random(n) < 0.45, self.syntax.sample(n), idents.sample(n))
        return np.concatenate([np.full(depth, self.indent, np.int32), body.astype(np.int32),
                               np.array([self.newline], np.int32)])


def agent_workload(seed: int, quick: bool) -> list[Request]:
    """Synthetic agent sessions editing code files, re-sending the whole conversation each turn.

    A turn's response is some reasoning followed by an edit: either the whole file re-emitted with a few edits, or a
    search/replace pair (a verbatim snippet of the file, then the snippet edited). Tool output (an observation, at
    times a window of the file) follows. A session either starts by showing the file or recalls it: then it is only in
    earlier sessions' responses, which the global cache holds. Files carry over from session to session.
    """
    rng = np.random.default_rng(seed)
    prose = TokenSource(rng, rng.permutation(VOCAB_SIZE).astype(np.int32))
    code = CodeWriter(rng)
    n_files, n_sessions, n_turns, file_tokens = (2, 4, 3, 400) if quick else (3, 12, 4, 3000)
    files = [code.new_file(file_tokens) for _ in range(n_files)]
    system = prose.sample(300)
    requests = []
    for s in range(n_sessions):
        f = s % n_files
        history = [system, prose.sample(int(rng.integers(20, 80)))]
        if s < n_files or rng.random() < 0.4:  # the first tool call shows the file; otherwise it is recalled
            history += [prose.sample(10), *files[f]]
        previous = None
        for t in range(n_turns):
            reasoning = prose.sample(int(rng.integers(20, 120)))
            if rng.random() < 0.35:
                files[f] = code.edit(files[f], n_edits=int(rng.integers(1, 5)))
                action = [*files[f]]
            else:
                i = int(rng.integers(len(files[f])))
                j = min(len(files[f]), i + int(rng.integers(3, 25)))
                old = files[f][i:j]
                new = code.edit(old, n_edits=int(rng.integers(1, 3)))
                files[f] = files[f][:i] + new + files[f][j:]
                action = [*old, prose.sample(3), *new]
            response = np.concatenate([reasoning, *action, prose.sample(int(rng.integers(2, 10)))])
            prompt = np.concatenate(history)
            rid = f"agent-s{s}-t{t}"
            requests.append(Request(rid, prompt, response, extends=previous))
            history = [prompt, response, prose.sample(int(rng.integers(20, 80)))]  # the observation
            if rng.random() < 0.3:  # the agent looks at part of the file again
                i = int(rng.integers(len(files[f])))
                history += files[f][i:i + int(rng.integers(20, 60))]
            previous = rid
    return requests


def random_workload(seed: int, quick: bool) -> list[Request]:
    """Independent requests of uniformly random tokens: nothing to copy, every draft is overhead."""
    rng = np.random.default_rng(seed + 1)
    n_requests, prompt_len, response_len = (3, 300, 100) if quick else (8, 2000, 600)
    return [Request(f"random-{i}", rng.integers(0, VOCAB_SIZE, prompt_len, dtype=np.int32),
                    rng.integers(0, VOCAB_SIZE, response_len, dtype=np.int32)) for i in range(n_requests)]


WORKLOADS: dict[str, Callable[[int, bool], list[Request]]] = {"agent": agent_workload, "random": random_workload}


# ---------------------------------------------------------------- proposers

def make_proposer(name: str, args: argparse.Namespace):
    """A fresh proposer at the benchmark's settings, or ImportError if it is not installed here."""
    if name == "hybridspec":
        from hybridspec.suffix import SuffixCache

        return SuffixCache(max_depth=args.max_depth, num_speculative_tokens=args.num_speculative_tokens,
                           max_spec_factor=args.max_spec_factor, max_spec_offset=args.max_spec_offset,
                           min_token_prob=args.min_token_prob)
    if name == "arctic-suffix":
        from hybridspec.tools.peers import ArcticSuffixProposer

        return ArcticSuffixProposer(max_depth=args.max_depth, num_speculative_tokens=args.num_speculative_tokens,
                                    max_spec_factor=args.max_spec_factor, max_spec_offset=args.max_spec_offset,
                                    min_token_prob=args.min_token_prob)
    if name == "ngram":
        from hybridspec.suffix import NgramProposer

        return NgramProposer(num_speculative_tokens=args.num_speculative_tokens)
    raise ValueError(f"unknown proposer {name!r}")


BYTES_PER_TOKEN_METHOD = {
    "hybridspec": "SuffixCache.memory_bytes() / indexed_tokens() (global tree + live and retained request trees)",
    "arctic-suffix": "SuffixTree.estimate_memory() of its global and request trees (the peer's own estimate) / tokens "
                     "in them",
    "ngram": "token buffer bytes / tokens held (active and retained contexts)",
}


# ---------------------------------------------------------------- driver

def warm_up(proposer) -> None:
    """Compile lazily jitted code (numba) outside the timed region."""
    proposer.start_request("__warmup__", np.arange(64, dtype=np.int32) % 7)
    proposer.speculate("__warmup__")
    proposer.append("__warmup__", np.array([1], np.int32))
    proposer.abort_request("__warmup__")


def run_workload(requests: list[Request], proposers: dict, label: str,
                 num_speculative_tokens: int) -> dict[str, dict[str, float]]:
    """Every request through every proposer, as trace replay drives them (hybridspec.agent_traces.replay)."""
    recorders = {name: Recorder() for name in proposers}
    gc.disable()  # no collector pauses inside timed calls
    try:
        for req in tqdm(requests, desc=label, disable=not sys.stderr.isatty(), leave=False):
            for name, proposer in proposers.items():
                replay_call(proposer, req.request_id, req.prompt, req.response, req.extends, num_speculative_tokens,
                            recorders[name])
    finally:
        gc.enable()
    results = {}
    for name, proposer in proposers.items():
        t = recorders[name].finish()
        held = proposer.indexed_tokens()
        results[name] = {
            "us_per_speculate": float(np.median(t.speculate_ns)) / 1e3,
            # finishing is part of the append cost: the peer indexes response tokens globally as they are appended,
            # hybridspec when the request finishes
            "us_per_append_token": (t.append_ns + t.finish_ns) / 1e3 / max(t.response_tokens, 1),
            "tokens_per_step": t.response_tokens / max(t.steps, 1),
            "bytes_per_token": proposer.memory_bytes() / held if held else 0.0,
            "prompt_index_ms_per_1k": t.start_ns / 1e6 / max(t.prompt_tokens, 1) * 1e3,
        }
    return results


TIMINGS = ("us_per_speculate", "us_per_append_token", "prompt_index_ms_per_1k")


def best_of(runs) -> dict[str, float]:
    """Timings: the fastest run (noise on a shared machine only adds time). Counts are the same in every run."""
    runs = list(runs)
    return {k: min(r[k] for r in runs) if k in TIMINGS else runs[0][k] for k in runs[0]}


# ---------------------------------------------------------------- report

def target_rows(results: dict) -> list[tuple[str, str, str]]:
    """(target, measured, PASS/FAIL/n/a) for the suffix tree's targets, as ratios against the peer in the same run."""
    rows = []

    def ratio_row(what: str, workload: str, key: str, other: str, limit: float, higher_is_better: bool) -> None:
        r = results.get(workload, {})
        if "hybridspec" not in r or other not in r:
            rows.append((what, f"({'hybridspec' if 'hybridspec' not in r else other} not run)", "n/a"))
            return
        ours, theirs = r["hybridspec"][key], r[other][key]
        ratio = ours / theirs if theirs else float("inf")
        ok = ratio >= limit if higher_is_better else ratio <= limit
        rows.append((what, f"{ratio:.3f} ({ours:.3g} vs {theirs:.3g})", "PASS" if ok else "FAIL"))

    for w in results:
        ratio_row(f"{w}: speculate us ours/arctic-suffix <= 0.5", w, "us_per_speculate", "arctic-suffix", 0.5, False)
    ratio_row("agent: tokens/step ours/arctic-suffix >= 1", "agent", "tokens_per_step", "arctic-suffix", 1.0, True)
    ratio_row("agent: tokens/step ours/ngram >= 1", "agent", "tokens_per_step", "ngram", 1.0, True)
    for w in results:
        ratio_row(f"{w}: append us/token ours/arctic-suffix <= 1", w, "us_per_append_token", "arctic-suffix", 1.0,
                  False)
    for w, r in results.items():
        if "hybridspec" in r:
            b = r["hybridspec"]["bytes_per_token"]
            rows.append((f"{w}: ours bytes/token <= 50", f"{b:.1f}", "PASS" if b <= 50 else "FAIL"))
        else:
            rows.append((f"{w}: ours bytes/token <= 50", "(hybridspec not run)", "n/a"))
    return rows


def print_report(results: dict, notes: list[str]) -> None:
    cols = ["us_per_speculate", "us_per_append_token", "tokens_per_step", "bytes_per_token", "prompt_index_ms_per_1k"]
    head = f"{'workload':<9} {'proposer':<11}" + "".join(f"{c:>24}" for c in cols)
    print(head)
    print("-" * len(head))
    for w, per in results.items():
        for name, m in per.items():
            print(f"{w:<9} {name:<11}" + "".join(f"{m[c]:>24.3f}" for c in cols))
    print()
    rows = target_rows(results)
    width = max(len(r[0]) for r in rows)
    print("targets (against the peer, same run)")
    for what, measured, verdict in rows:
        print(f"  {what:<{width}}  {measured:<32} {verdict}")
    for note in notes:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    ap.add_argument("--max-depth", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=16)
    ap.add_argument("--max-spec-factor", type=float, default=1.0)
    ap.add_argument("--max-spec-offset", type=float, default=0.0)
    ap.add_argument("--min-token-prob", type=float, default=0.1)
    ap.add_argument("--proposers", default="hybridspec,arctic-suffix,ngram", help="comma-separated subset")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="runs per workload; timings are the best of them")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")

    names = [n.strip() for n in args.proposers.split(",") if n.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r} (choose from {', '.join(WORKLOADS)})")
    notes = []
    available = []
    for name in names:
        if name not in BYTES_PER_TOKEN_METHOD:
            ap.error(f"unknown proposer {name!r} (choose from {', '.join(BYTES_PER_TOKEN_METHOD)})")
        try:
            warm_up(make_proposer(name, args))
            available.append(name)
        except ImportError as e:
            notes.append(f"skipped {name}: {e}")

    results = {}
    for w in workloads:
        requests = WORKLOADS[w](args.seed, args.quick)
        # fresh proposers per run: each starts with an empty global cache
        runs = [run_workload(requests, {n: make_proposer(n, args) for n in available}, f"{w} {r + 1}/{args.repeat}",
                             args.num_speculative_tokens) for r in range(args.repeat)]
        results[w] = {n: best_of(run[n] for run in runs) for n in available}

    settings = dict(max_depth=args.max_depth, num_speculative_tokens=args.num_speculative_tokens,
                    max_spec_factor=args.max_spec_factor, max_spec_offset=args.max_spec_offset,
                    min_token_prob=args.min_token_prob, seed=args.seed, quick=args.quick, repeat=args.repeat,
                    timings="best of `repeat` runs; us_per_speculate is the median call of a run, us_per_append_token "
                            "includes finish_request (global indexing of the response)", proposers=available,
                    ngram=dict(min_n=2, max_n=5), vocab_size=VOCAB_SIZE, python=sys.executable,
                    bytes_per_token_method={n: BYTES_PER_TOKEN_METHOD[n] for n in available}, notes=notes)
    print_report(results, notes)
    write_json(args.json, {"workloads": results, "settings": settings, "machine": machine_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
