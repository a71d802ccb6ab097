"""The harness of the benchmarks that run calls on several methods and compare them (bench_agent_calls, bench_serve,
bench_mixed, bench_e2e): the per-call record, the two ways of replaying calls, the summaries, ratios against named
peers, targets, the table, the JSON and the plot. A script keeps what it alone measures: its methods and how one of
them runs a call (a `CallRecord` back).

Replays: `interleave` (concurrency 1: every method runs a call before the next call starts, the methods taking turns
in a rotating order, so that load from other processes falls on all alike) and `replay` (concurrency C, closed loop:
C agents at once, each sending its trajectory's calls one after the other).

The JSON every one of them writes (`report`):

    methods     the headline: workloads["overall"] at the lowest concurrency run, {method: summary}
    workloads   {workload: {"concurrency-C": {method: summary}}}. "overall" is every call; a call's workload is its
                agent framework (SWE-agent, mini-swe-agent, AutoCodeRover), or agent / chat / code where a script
                mixes those. Per workload at concurrency 1 only: a concurrent replay's wall time is shared by all.
    targets     {name: {"ratio", "target", "pass", ...}}: a method's tok_s over a peer's, and the ratio it should reach
    reference   the method whose outputs every method's are compared with
    outputs_compared  "tokens" (token ids, EOS included) or "text" (where servers return text)
    not_run     {method, or method@C: why}: the methods that could not run here
    calls       [{trajectory, index, workload, prompt_tokens}]: the calls, in order
    per_call    every run of a call: the `CallRecord` but its output and engine stats, with concurrency and identical
    wall_s, config, machine: the benchmark's wall time, its arguments, the machine's record
    (and what a script adds of its own: bench_agent_calls' and bench_serve's vllm, bench_e2e's sessions)

A summary (`summarize`: one method's calls of one workload at one concurrency):

    calls            calls run
    compared_calls   of those, calls the reference ran too
    identical_calls  of those, calls whose output equals the reference's
    new_tokens       generated tokens (EOS included where generated; a server's usage.completion_tokens)
    prompt_tokens    the calls' prompt tokens (the chat template's token ids)
    total_s          whole-call seconds (from sending a call to its last token), summed over the calls
    wall_s           the wall time of the replay the calls ran in, where they ran as one
    tok_s            new_tokens over total_s at concurrency 1, over wall_s at concurrency C (all agents' tokens)
    per_call_tok_s   concurrency C: new_tokens over total_s, the calls' own speed
    ttft_s           median seconds from sending a call until its first generated token was there
    decode_tok_s     speed after the first token: (new_tokens - calls) over (total_s - the ttfts); None where a ttft
                     is unknown
    tokens_per_step  new tokens per forward pass that produced tokens; None where unknown
    vs_<peer>        tok_s over a named peer's (vs_transformers, vs_best_vllm, vs_engine, vs_none; decode_vs_none:
                     decode_tok_s over none's); None where the peer did not run
    engine           hybridspec's `GenerationStats.as_dict()` summed over the calls (acceptance, drafter_runs, ...),
                     where the method ran on an Engine in the benchmark's process
    prompt_token_mismatches  where a server counted the prompts: calls whose count differs from the chat template's
    (and what a script adds: bench_serve's server counters and load_s)

Light like agent_calls: neither torch nor vLLM at import.
"""
from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent_calls import AgentCall, chat_token_ids
from common import VLLM_ENV, bar_plot, machine_info, write_json

OVERALL = "overall"  # the workload of every call

# The vLLM peer of the agent-call replays: vLLM's documented examples, n-gram K=5 over up to 4-grams, suffix decoding
# at its own defaults (K = tree depth 24); without speculation ("none").
VLLM_SPECULATIVE_CONFIGS: dict[str, dict | None] = {
    "none": None, "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix"}}
# One OpenMP thread, unbound (the machine is shared); 2 GiB of KV cache (~46k tokens: four agents of calls up to 8k
# tokens; the budget of hybridspec's prefix cache, PREFIX_CACHE_BYTES).
VLLM_REPLAY_ENV = {**VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


class MethodFailed(RuntimeError):
    """A method that cannot run here (reported under not_run, with the reason)."""


# ------------------------------------------------------------------------------------------------------ the record


@dataclass
class CallRecord:
    """One method's run of one call."""

    method: str
    workload: str
    trajectory: str
    index: int
    prompt_tokens: int  # the chat template's token ids
    new_tokens: int
    output: list[int] | str = field(repr=False)  # what is compared with the reference: token ids, or a server's text
    total_s: float
    ttft_s: float | None
    steps: int | None = None  # forward passes that produced tokens; None where unknown
    finish_reason: str | None = None
    server_prompt_tokens: int | None = None  # a server's usage.prompt_tokens (its own chat template)
    stats: Any = field(default=None, repr=False)  # the Engine's GenerationStats of the call, where it ran on one

    @property
    def key(self) -> tuple[str, int]:
        """What the call is known by across methods: its trajectory and index."""
        return self.trajectory, self.index


def record(method: str, call: AgentCall, output: Sequence[int] | str, total_s: float, ttft_s: float | None,
           steps: int | None = None, new_tokens: int | None = None, **extra: Any) -> CallRecord:
    """`method`'s record of `call`: new_tokens counts the output's tokens unless given (a text output)."""
    output = output if isinstance(output, str) else list(output)
    return CallRecord(method, call.workload, call.trajectory, call.index, len(call.prompt_token_ids),
                      len(output) if new_tokens is None else new_tokens, output, total_s, ttft_s, steps, **extra)


def engine_record(method: str, call: AgentCall, result: Any, total_s: float, output: str = "tokens") -> CallRecord:
    """The record of an Engine's `GenerationResult` for `call`: its token ids (or, output="text", its text), first
    token time, steps and stats."""
    return record(method, call, result.token_ids if output == "tokens" else result.text, total_s,
                  result.stats.first_token_s or None, result.stats.steps, new_tokens=len(result.token_ids),
                  finish_reason=result.finish_reason, stats=result.stats)


def engine_call(engine: Any, method: str, output: str = "tokens", **options: Any) -> Callable[[AgentCall], CallRecord]:
    """`method` on an Engine: a call's token ids through `engine.generate(ids, **options)`, timed around it."""
    def run(call: AgentCall) -> CallRecord:
        start = time.perf_counter()
        result = engine.generate(call.prompt_token_ids, **options)
        return engine_record(method, call, result, time.perf_counter() - start, output)

    return run


def warmup_call(tokenizer: Any) -> AgentCall:
    """A short untimed call that warms a method up (kernels, drafters loaded) before its timed ones."""
    messages = [{"role": "user", "content": "Hello"}]
    return AgentCall("warmup", 0, messages, chat_token_ids(tokenizer, messages))


def by_method(records: Iterable[CallRecord], order: Sequence[str] = ()) -> dict[str, list[CallRecord]]:
    """The records of each method, the methods in `order` first."""
    grouped: dict[str, list[CallRecord]] = {}
    for r in records:
        grouped.setdefault(r.method, []).append(r)
    ranked = {m: i for i, m in enumerate(order)}
    return {m: grouped[m] for m in sorted(grouped, key=lambda m: ranked.get(m, len(ranked)))}


def reference_outputs(records: Iterable[CallRecord], method: str) -> dict[tuple[str, int], list[int] | str]:
    """The outputs of the reference `method`, by call."""
    return {r.key: r.output for r in records if r.method == method}


# ------------------------------------------------------------------------------------------------------ replaying


def rotation(methods: Sequence[str], k: int) -> list[str]:
    """The methods' order for the k-th call: each goes first in turn."""
    return list(methods[k % len(methods):]) + list(methods[:k % len(methods)]) if methods else []


def interleave(run: Mapping[str, Callable[[AgentCall], CallRecord]], calls: Sequence[AgentCall],
               desc: str = "calls x methods") -> list[CallRecord]:
    """Concurrency 1: every method (`run[method](call)`) runs a call before the next call starts, in `rotation`. A
    progress bar, or on a log file a line per call."""
    from tqdm import tqdm

    records: list[CallRecord] = []
    with tqdm(total=len(calls) * len(run), desc=desc, unit="call", disable=None) as progress:
        for k, call in enumerate(calls):
            for method in rotation(list(run), k):
                progress.set_postfix_str(f"{call.workload} #{call.index} {method}")
                records.append(run[method](call))
                progress.update(1)
            if progress.disable:
                print(f"call {k + 1}/{len(calls)} done ({call.trajectory} #{call.index}, "
                      f"{len(call.prompt_token_ids)} prompt tokens)", file=sys.stderr, flush=True)
    return records


def replay(run_call: Callable[[AgentCall], CallRecord], trajectories: Sequence[Sequence[AgentCall]],
           concurrency: int, per_thread: Callable[[], None] | None = None) -> tuple[list[CallRecord], float]:
    """Closed loop: `concurrency` agents at once (threads, each first running `per_thread`), each taking the next
    trajectory not yet started and sending its calls one after the other; the records in trajectory order and the
    wall time."""
    def agent(calls: Sequence[AgentCall]) -> list[CallRecord]:
        if per_thread is not None:
            per_thread()
        return [run_call(call) for call in calls]

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        per_trajectory = list(pool.map(agent, trajectories))
    return [r for rs in per_trajectory for r in rs], time.perf_counter() - start


# ------------------------------------------------------------------------------------------------------ summaries


def summarize(records: Sequence[CallRecord], reference: Mapping[tuple[str, int], Any], concurrency: int = 1,
              wall_s: float | None = None) -> dict[str, Any]:
    """One method's calls, summed up (the keys: this module's docstring); tok/s over the summed call times at
    concurrency 1, over `wall_s` above."""
    new_tokens = sum(r.new_tokens for r in records)
    total_s = sum(r.total_s for r in records)
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    steps = [r.steps for r in records if r.steps is not None]
    compared = [r for r in records if r.key in reference]
    after_first = sum(r.total_s - r.ttft_s for r in records) if len(ttfts) == len(records) else 0.0
    span = total_s if concurrency == 1 else wall_s
    summary: dict[str, Any] = {
        "tok_s": round(new_tokens / span, 3) if span else 0.0,
        "ttft_s": round(statistics.median(ttfts), 4) if ttfts else None,
        "decode_tok_s": round((new_tokens - len(records)) / after_first, 3) if after_first > 0 else None,
        "tokens_per_step": round(new_tokens / sum(steps), 3) if len(steps) == len(records) and sum(steps) else None,
        "identical_calls": sum(r.output == reference[r.key] for r in compared),
        "compared_calls": len(compared),
        "calls": len(records),
        "new_tokens": new_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "total_s": round(total_s, 3),
    }
    if wall_s is not None:
        summary["wall_s"] = round(wall_s, 3)
    if concurrency > 1:
        summary["per_call_tok_s"] = round(new_tokens / total_s, 3) if total_s else 0.0
    if any(r.server_prompt_tokens is not None for r in records):
        summary["prompt_token_mismatches"] = sum(r.server_prompt_tokens not in (None, r.prompt_tokens)
                                                 for r in records)
    if records and all(r.stats is not None for r in records):
        engine = type(records[0].stats)()
        for r in records:
            engine.add(r.stats)
        summary["engine"] = engine.as_dict()
    return summary


def summarize_runs(runs: Mapping[str, Sequence[CallRecord]], reference: Mapping[tuple[str, int], Any],
                   concurrency: int = 1, wall_s: Mapping[str, float] | None = None) -> dict[str, dict[str, dict]]:
    """{workload: {method: summary}} of one concurrency's runs ({method: its records; wall_s: its replay's}):
    "overall" first, then at concurrency 1 each workload in the calls' order."""
    wall_s = wall_s or {}
    tables = {OVERALL: {m: summarize(rs, reference, concurrency, wall_s.get(m)) for m, rs in runs.items() if rs}}
    if concurrency == 1:
        for workload in dict.fromkeys(r.workload for rs in runs.values() for r in rs):
            tables[workload] = {m: summarize(mine, reference) for m, rs in runs.items()
                                if (mine := [r for r in rs if r.workload == workload])}
    return tables


def level(concurrency: int) -> str:
    """The key of a concurrency in `workloads`."""
    return f"concurrency-{concurrency}"


def lowest(levels: Mapping[str, dict]) -> dict:
    """Of {"concurrency-C": table}, the table of the lowest concurrency."""
    return levels[min(levels, key=lambda name: int(name.rsplit("-", 1)[1]))]


def add_level(workloads: dict[str, dict[str, dict]], concurrency: int, tables: Mapping[str, dict]) -> None:
    """Files one concurrency's {workload: {method: summary}} under workloads[workload][level(concurrency)]."""
    for workload, table in tables.items():
        if table:
            workloads.setdefault(workload, {})[level(concurrency)] = table


def add_ratio(table: Mapping[str, dict], key: str, peer: dict | None | Callable[[str], dict | None],
              figure: str = "tok_s") -> None:
    """summary[key] = summary[figure] over the peer's, on every method of `table` ({method: summary}); `peer` is the
    peer's summary, or a function of a method's name giving its peer's; None where there is no peer or figure."""
    for method, summary in table.items():
        theirs = peer(method) if callable(peer) else peer
        ours = summary.get(figure)
        summary[key] = (round(ours / theirs[figure], 3) if theirs and theirs.get(figure) and ours is not None
                        else None)


def best(table: Mapping[str, dict], methods: Iterable[str]) -> str | None:
    """Of `methods`, the one in `table` with the highest tok/s; None where none of them ran."""
    ran = [m for m in methods if m in table]
    return max(ran, key=lambda m: table[m]["tok_s"]) if ran else None


def target(ours: dict | None, peer: dict | None, goal: float, identical: bool = False,
           **extra: Any) -> dict[str, Any] | None:
    """A target: our tok/s over the peer's should reach `goal` (and, with `identical`, every call's output equal the
    reference's); None where either did not run."""
    if not ours or not peer:
        return None
    ratio = ours["tok_s"] / peer["tok_s"] if peer["tok_s"] else 0.0
    out: dict[str, Any] = {"ratio": round(ratio, 3), **extra, "target": goal, "pass": ratio >= goal}
    if identical:
        out["identical"] = ours["identical_calls"] == ours["calls"]
        out["pass"] = out["pass"] and out["identical"]
    return out


def print_targets(targets: Mapping[str, dict], not_run: Mapping[str, str] | None = None) -> None:
    """A line per target (met or missed), then per method that did not run, the first line of its reason."""
    for name, goal in targets.items():
        print(f"target {name}: {goal['ratio']:.2f}x >= {goal['target']:.2f}x: {'ok' if goal['pass'] else 'MISS'}")
    for name, reason in (not_run or {}).items():
        print(f"not run: {name}: {reason.splitlines()[0] if reason else ''}")


# ------------------------------------------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Column:
    """A table column: its header, its least width and a row's text in it (a row: a summary with its "workload"
    and "method")."""

    header: str
    width: int
    cell: Callable[[dict], str]
    left: bool = False


def number(key: str, fmt: str = "{:.2f}") -> Callable[[dict], str]:
    """A cell showing row[key] in `fmt`, "-" where it is None or missing."""
    return lambda row: "-" if row.get(key) is None else fmt.format(row[key])


def ratio_column(key: str, header: str) -> Column:
    """A column of a vs_<peer> ratio, as 1.25x."""
    return Column(header, max(9, len(header) + 2), number(key, "{:.2f}x"))


METHOD = Column("method", 24, lambda row: row["method"], left=True)
WORKLOAD = Column("workload", 10, lambda row: row["workload"], left=True)
TOK_S = Column("tok/s", 9, number("tok_s"))
TTFT = Column("ttft s", 9, number("ttft_s", "{:.3f}"))
TOKENS_PER_STEP = Column("tokens/step", 13, number("tokens_per_step"))
IDENTICAL = Column("identical", 11, lambda row: f"{row['identical_calls']}/{row['compared_calls']}"
                   if row["compared_calls"] else "-")


def rows(tables: Mapping[str, Mapping[str, dict]], methods: Callable[[str], bool] = lambda m: True) -> list[dict]:
    """The rows of {workload: {method: summary}}, "overall" last, of the methods that `methods` keeps."""
    ordered = sorted(tables, key=lambda workload: workload == OVERALL)
    return [{**s, "workload": workload, "method": method} for workload in ordered
            for method, s in tables[workload].items() if methods(method)]


def print_table(title: str, table_rows: Sequence[dict], columns: Sequence[Column]) -> None:
    """The rows under a header line of the columns; a left-aligned column widens to its longest text."""
    cells = [[column.cell(row) for column in columns] for row in table_rows]
    widths = [max([column.width] + [len(c[i]) + 2 for c in cells]) if column.left else column.width
              for i, column in enumerate(columns)]
    print(f"\n{title}")
    for line in [[column.header for column in columns], *cells]:
        print("".join(f"{text:<{w}}" if column.left else f"{text:>{w}}"
                      for text, w, column in zip(line, widths, columns)).rstrip())


# ------------------------------------------------------------------------------------------------------ the JSON


def per_call(r: CallRecord, concurrency: int, reference: Mapping[tuple[str, int], Any]) -> dict[str, Any]:
    """A record in the JSON: its fields but the output and the engine stats; identical: None where the reference
    did not run the call."""
    return ({k: v for k, v in asdict(r).items() if k not in ("output", "stats")}
            | {"concurrency": concurrency, "identical": r.output == reference[r.key] if r.key in reference else None})


def report(args: Any, started: float, *, workloads: dict[str, dict[str, dict]], targets: dict[str, dict],
           reference: str, outputs: Mapping[tuple[str, int], Any], records: Mapping[int, Sequence[CallRecord]],
           not_run: Mapping[str, str] | None = None, outputs_compared: str = "tokens", **extra: Any) -> dict[str, Any]:
    """The JSON of a benchmark (this module's docstring): `reference` names the method whose `outputs` the others'
    are compared with; `records` are every concurrency's ({C: records}, the calls listed in the order of the lowest
    concurrency's); `extra` are the script's own keys."""
    overall = workloads.get(OVERALL, {})
    first: dict[tuple[str, int], CallRecord] = {}
    for c in sorted(records):
        for r in records[c]:
            first.setdefault(r.key, r)
    return {"methods": lowest(overall) if overall else {},
            "workloads": workloads, "targets": targets, "reference": reference, "outputs_compared": outputs_compared,
            "not_run": dict(not_run or {}),
            "calls": [{"trajectory": r.trajectory, "index": r.index, "workload": r.workload,
                       "prompt_tokens": r.prompt_tokens} for r in first.values()],
            "per_call": [per_call(r, c, outputs) for c, rs in records.items() for r in rs],
            **extra,
            "wall_s": round(time.perf_counter() - started, 1),
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": machine_info()}


def plot(path: Path, workloads: Mapping[str, Mapping[str, dict]], title: str,
         by_workload: bool = False) -> Path | None:
    """Whole-call tokens/s beside `path` (its .png): by method, a bar per concurrency (every call); or, with
    `by_workload`, by workload at the lowest concurrency, a bar per method. None without matplotlib."""
    if by_workload:
        tables = {w: lowest(levels) for w, levels in workloads.items()}
        methods = list(dict.fromkeys(m for table in tables.values() for m in table))
        series = {m: {w: table[m]["tok_s"] for w, table in tables.items() if m in table} for m in methods}
        return bar_plot(path, list(tables), series, "whole-call tokens/s", title)
    levels = workloads.get(OVERALL, {})
    methods = list(dict.fromkeys(m for table in levels.values() for m in table))
    series = {name.replace("-", " "): {m: s["tok_s"] for m, s in table.items()} for name, table in levels.items()}
    return bar_plot(path, methods, series, "whole-call tokens/s (at concurrency C: all agents')", title, rotate=True)


def write(path: Path | None, result: dict[str, Any], title: str, by_workload: bool = False) -> None:
    """The JSON at `path` and its plot beside it; nothing without a path."""
    write_json(path, result)
    if path and result["workloads"]:
        png = plot(path, result["workloads"], title, by_workload)
        if png:
            print(f"wrote {png}")
