"""A burst of agent requests at once on `hybridspec serve`: none lost, memory within the budget, every output as alone.

Issue 34's burst: N real agent calls (default 256: 32 trajectories x their first 8 calls of at most 4096 prompt
tokens, from ../shared/agent_traces as bench_serve loads them) sent together as streamed chat requests (the `openai`
client, greedy, `--max-tokens` new tokens), in a seeded shuffled order, to one `hybridspec serve` with a KV budget far
below what they would hold together (`--kv-cache-memory`, default 2G) and `--max-num-seqs` running at once; the rest
wait in its queue (`--max-waiting`, default 1024: none refused). Consecutive calls of a trajectory share their prompt's
beginning, and calls of one framework its system prompt: the server computes those positions once (in-flight prefix
sharing, then the prefix cache), as a real burst of agents lets it.

Then every accepted request is sent again alone, one after the other, and its text compared with the burst's.

Figures: requests sent, completed, refused (429), failed (any other error: lost); identical to alone; the burst's wall
time, completion tok/s, median and 90th-percentile time to first token, mean queue time (the server's histogram);
the server's resident memory (its process tree, sampled every 0.2 s) before the burst (the model loaded and warm) and
at its peak, against the budget: baseline + KV budget + prefix-cache budget + the step reserve
(`hybridspec.runtime.admission.STEP_RESERVE_BYTES`); the gauges at their peak (running, waiting, KV usage).

    .venv/bin/python benchmarks/bench_burst.py --json out/bench_burst.json            # 256 requests: ~15-30 min
    .venv/bin/python benchmarks/bench_burst.py --trajectories 2 --calls-per-trajectory 2 --max-tokens 8 \
        --json /tmp/burst.json                                                          # a smoke run
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agent_calls import AgentCall, load_agent_calls
from bench_serve import (GAUGE_NAMES, HYBRIDSPEC_CLI, Peaks, RSS_INTERVAL_S, GAUGE_INTERVAL_S, Server, chat_call,
                         counter_deltas, free_port, serve_argv, tree_rss)
from common import TRACES_DIR, write_json
from harness import MethodFailed, warmup_call

GIB = 1 << 30


def burst_order(calls: list[AgentCall], seed: int) -> list[AgentCall]:
    """The calls in the order they are sent: shuffled with `seed` (a burst arrives in no particular order)."""
    order = list(calls)
    random.Random(seed).shuffle(order)
    return order


def send(client, name: str, call: AgentCall, max_tokens: int) -> dict[str, Any]:
    """One streamed request: its status ("ok", "refused" for a 429, "failed" for anything else) and record."""
    import openai

    try:
        return {"status": "ok", "record": chat_call(client, name, call, max_tokens)}
    except openai.RateLimitError as e:
        return {"status": "refused", "error": str(e)}
    except (openai.OpenAIError, MethodFailed) as e:
        return {"status": "failed", "error": f"{type(e).__name__}: {e}"}


def summary(results: list[dict[str, Any]], alone: dict[int, str], wall_s: float, baseline: int, peak: int,
            budget: int, server: dict[str, float], gauges: dict[str, float]) -> dict[str, Any]:
    done = [r["record"] for r in results if r["status"] == "ok"]
    ttfts = sorted(r.ttft_s for r in done if r.ttft_s is not None)
    identical = sum(results[i]["record"].output == text for i, text in alone.items())
    return {
        "requests": len(results), "completed": len(done),
        "refused": sum(r["status"] == "refused" for r in results),
        "failed": sum(r["status"] == "failed" for r in results),
        "errors": [r["error"] for r in results if r["status"] == "failed"][:5],
        "identical": identical, "compared": len(alone),
        "wall_s": round(wall_s, 1), "tok_s": round(sum(r.new_tokens for r in done) / wall_s, 2),
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "ttft_median_s": round(statistics.median(ttfts), 2) if ttfts else None,
        "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 2) if ttfts else None,
        "queue_s": server.get("queue_s"),
        "baseline_rss_gib": round(baseline / GIB, 3), "peak_rss_gib": round(peak / GIB, 3),
        "budget_gib": round(budget / GIB, 3), "within_budget": peak <= budget,
        "peaks": {name.split(":", 1)[1]: value for name, value in gauges.items()},
        "server": server,
    }


def print_summary(s: dict[str, Any]) -> None:
    rows = [("requests sent", s["requests"]), ("completed", s["completed"]), ("refused (429)", s["refused"]),
            ("failed (lost)", s["failed"]), ("identical to alone", f"{s['identical']}/{s['compared']}"),
            ("burst wall time", f"{s['wall_s']} s"), ("completion tok/s", s["tok_s"]),
            ("prompt tokens", s["prompt_tokens"]),
            ("TTFT median / p90", f"{s['ttft_median_s']} / {s['ttft_p90_s']} s"), ("mean queue time", s["queue_s"]),
            ("RSS before / peak", f"{s['baseline_rss_gib']} / {s['peak_rss_gib']} GiB"),
            ("budget (model + KV + prefix + step)", f"{s['budget_gib']} GiB: "
                                                    f"{'within' if s['within_budget'] else 'OVER'}"),
            ("peak running / waiting / KV use", " / ".join(str(s["peaks"].get(k)) for k in
                                                           ("num_requests_running", "num_requests_waiting",
                                                            "kv_cache_usage_perc")))]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> int:
    from hybridspec.model.loading import load_tokenizer
    from hybridspec.runtime.admission import STEP_RESERVE_BYTES
    from hybridspec.serve import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--calls-per-trajectory", type=int, default=8)
    p.add_argument("--max-prompt-tokens", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--speculate", default="suffix")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-waiting", type=int, default=1024)
    p.add_argument("--kv-cache-memory", default="2G")
    p.add_argument("--prefix-cache-memory", default="1G")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-alone", action="store_true", help="skip sending each request again alone")
    p.add_argument("--request-timeout", type=float, default=7200.0)
    p.add_argument("--traces-dir", type=Path, default=TRACES_DIR)
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import openai

    if not HYBRIDSPEC_CLI.exists():
        raise SystemExit(f"{HYBRIDSPEC_CLI} is missing (scripts/setup.sh makes it)")
    kv, prefix = parse_size(args.kv_cache_memory), parse_size(args.prefix_cache_memory)
    tokenizer = load_tokenizer(args.model)
    trajectories = load_agent_calls(tokenizer, trajectories=args.trajectories,
                                    calls_per_trajectory=args.calls_per_trajectory,
                                    max_prompt_tokens=args.max_prompt_tokens, traces_dir=args.traces_dir)
    calls = burst_order([c for t in trajectories for c in t], args.seed)
    sizes = [len(c.prompt_token_ids) for c in calls]
    print(f"{len(calls)} requests, prompts of {min(sizes)}-{max(sizes)} tokens ({sum(sizes)} in all)", file=sys.stderr)

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_burst-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv_ = serve_argv(args.model, port, "burst", args.speculate, args.threads) + [
        "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting),
        "--kv-cache-memory", str(kv), "--prefix-cache-bytes", str(prefix)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    with Server(argv_, env, port, log_dir / "serve.log") as server:
        server.wait_healthy(600)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=args.request_timeout,
                               max_retries=0)
        chat_call(client, "burst", warmup_call(tokenizer), 8)
        baseline = tree_rss(server.proc.pid)
        before = server.metrics()
        start = time.perf_counter()
        with Peaks(lambda: {"rss": tree_rss(server.proc.pid)}, RSS_INTERVAL_S) as memory, \
                Peaks(lambda: server.metrics(GAUGE_NAMES), GAUGE_INTERVAL_S) as gauges, \
                ThreadPoolExecutor(len(calls)) as pool:
            results = list(pool.map(lambda c: send(client, "burst", c, args.max_tokens), calls))
        wall_s = time.perf_counter() - start
        deltas = counter_deltas(before, server.metrics())
        alone: dict[int, str] = {}
        if not args.no_alone:
            from tqdm import tqdm

            # in trajectory order: each call finds the one before it in the prefix cache
            todo = sorted((i for i, r in enumerate(results) if r["status"] == "ok"),
                          key=lambda i: (calls[i].trajectory, calls[i].index))
            for i in tqdm(todo, desc="alone", unit="call", disable=None):
                alone[i] = chat_call(client, "burst", calls[i], args.max_tokens).output
    budget = baseline + kv + prefix + STEP_RESERVE_BYTES
    result = summary(results, alone, wall_s, baseline, memory.peaks["rss"], budget, deltas, gauges.peaks)
    result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print_summary(result)
    write_json(args.json, result)
    ok = result["failed"] == 0 and result["within_budget"] and result["identical"] == result["compared"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
