"""A soak of `hybridspec serve`: normal, cancelled, hostile and oversized requests mixed, at several concurrencies, for
a while. What it must survive unharmed (issue 49): every accepted normal request's reply equals the same request's
sent alone, no answer is a 500, and the server's resident memory comes back to within 10% of its level after warm-up.

The server: `.venv/bin/hybridspec serve MODEL` in a subprocess (one torch thread, `--max-body-size 1M` so that an
oversized body costs little to send, `--prefix-cache-bytes` 64M: full after the warm-up, so that memory which grows
past it is a leak and not the prefix cache filling towards its 2 GiB default; its evictions are exercised too).
Requests (JSON over httpx; each worker its own seeded mix):
- normal (half): MT-Bench first turns (../shared/workloads), greedy, `--max-tokens` new tokens, streamed or not, chat
  completions or the Responses API; the reference is each prompt sent alone first (which is also the warm-up);
- cancelled (a fifth): a streamed request closed after its first chunk, or a non-streamed one whose client times out
  after 0.2 s (the server must cancel both);
- hostile (a fifth): malformed JSON, lone surrogates, 5,000-deep nesting, unsatisfiable and unsupported schemas,
  absurd numbers, an unknown tool_choice: each must get a 4xx;
- oversized (a tenth): a 2 MB body (413) or a prompt of 100,000 characters (400, context_length_exceeded).
Each level runs `--duration-s` seconds with C workers, closed loop. Memory: the server's RSS (its process tree, from
/proc) after the warm-up (the references, then `--warmup-s` of the mix at the highest level: the working set of the
busiest batches), then after every level once it is idle, and its peak; a leak keeps growing level after level.

    .venv/bin/python benchmarks/bench_soak.py --json out/bench_soak.json                 # 1, 4, 16 workers, 3 min each
    .venv/bin/python benchmarks/bench_soak.py --concurrency 1,4 --duration-s 20 --max-requests 400 --warmup-s 10 \
        --json /tmp/soak.json                                                                # CI's size
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_serve import HYBRIDSPEC_CLI, MethodFailed, Peaks, Server, free_port, serve_argv, tree_rss
from common import WORKLOADS_DIR, machine_info, write_json

GIB = 1 << 30
KINDS = (("normal", 0.5), ("cancelled", 0.2), ("hostile", 0.2), ("oversized", 0.1))
MEMORY_TOLERANCE = 0.10
BODY_LIMIT = "1M"


def hostile_bodies() -> list[tuple[str, bytes]]:
    """(endpoint, raw body) of requests a server must refuse with a 4xx."""
    user = [{"role": "user", "content": "hi"}]

    def schema(s: Any) -> dict:
        return {"messages": user, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": s}}}

    chat = "/v1/chat/completions"
    cases: list[tuple[str, Any]] = [
        (chat, b'{"messages": [{"role": "user", "content": "hi"}'),
        (chat, b"\xff\xfe not utf-8"),
        (chat, {"messages": [{"role": "user", "content": "\ud800"}]}),
        (chat, {"messages": user, "tools": [{"type": "function", "function": {"name": "f", "description": "\udfff"}}]}),
        (chat, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        (chat, schema({"$ref": "#"})),
        (chat, schema({"type": "string", "pattern": "(a|aa)*b{1000}"})),
        (chat, schema({"type": "object", "properties": {"x": {"enum": [f"v{i}" for i in range(100_000)]}}})),
        (chat, {"messages": user, "max_tokens": 10**30}),
        (chat, {"messages": user, "temperature": float("nan")}),
        (chat, {"messages": user, "tool_choice": "sometimes"}),
        (chat, {"messages": [{"role": "tool", "content": "x"}]}),
        ("/v1/completions", {"prompt": "\ud800"}),
        ("/v1/responses", {"input": [{"type": "function_call_output"}]}),
        ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}),
    ]
    return [(e, b if isinstance(b, bytes) else json.dumps(b).encode()) for e, b in cases]


def prompts(n: int) -> list[str]:
    with open(WORKLOADS_DIR / "mt_bench_questions.jsonl") as f:
        return [json.loads(line)["turns"][0] for line in f][:n]


@dataclass
class Outcome:
    kind: str
    status: int | None  # None: the client left (or the connection dropped) before an answer
    ok: bool
    seconds: float
    note: str = ""


@dataclass
class Soak:
    url: str
    model: str
    max_tokens: int
    references: dict[tuple[int, str], str] = field(default_factory=dict)

    def normal_body(self, prompt: str, api: str, stream: bool) -> tuple[str, dict]:
        if api == "responses":
            return "/v1/responses", {"model": self.model, "input": prompt, "max_output_tokens": self.max_tokens,
                                     "temperature": 0, "stream": stream}
        return "/v1/chat/completions", {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": self.max_tokens, "temperature": 0, "stream": stream}

    def normal(self, client, prompt_id: int, prompt: str, api: str, stream: bool) -> tuple[int, str]:
        """The reply's status and text."""
        endpoint, body = self.normal_body(prompt, api, stream)
        if not stream:
            r = client.post(self.url + endpoint, json=body)
            if r.status_code != 200:
                return r.status_code, r.text
            data = r.json()
            return 200, data["choices"][0]["message"]["content"] if api == "chat" else data["output"][0]["content"][
                0]["text"]
        text = []
        with client.stream("POST", self.url + endpoint, json=body) as r:
            if r.status_code != 200:
                return r.status_code, r.read().decode()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return 500, json.dumps(event)
                if api == "chat":
                    text.append(event["choices"][0]["delta"].get("content") or "" if event["choices"] else "")
                elif event.get("type") == "response.output_text.delta":
                    text.append(event["delta"])
        return 200, "".join(text)


def run_request(soak: Soak, client, rng: random.Random, texts: list[str], hostile: list[tuple[str, bytes]],
                limit_bytes: int) -> Outcome:
    import httpx

    kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
    start = time.perf_counter()
    status: int | None = None
    ok, note = False, ""
    try:
        if kind == "normal":
            i = rng.randrange(len(texts))
            api, stream = rng.choice(("chat", "responses")), rng.random() < 0.5
            status, text = soak.normal(client, i, texts[i], api, stream)
            ok = status == 200 and text == soak.references[(i, api)]
            note = "" if ok else f"{api} stream={stream}: {text[:120]!r}"
        elif kind == "cancelled":
            endpoint, body = soak.normal_body(texts[rng.randrange(len(texts))], "chat", rng.random() < 0.5)
            if body["stream"]:
                with client.stream("POST", soak.url + endpoint, json=body) as r:
                    status = r.status_code
                    next(r.iter_lines(), None)  # then the client leaves
            else:
                try:
                    timeout = httpx.Timeout(30, read=0.2)
                    status = client.post(soak.url + endpoint, json=body, timeout=timeout).status_code
                except httpx.ReadTimeout:
                    status = None
            ok = status in (None, 200)
        elif kind == "hostile":
            endpoint, raw = rng.choice(hostile)
            r = client.post(soak.url + endpoint, content=raw, headers={"Content-Type": "application/json"})
            status, ok = r.status_code, 400 <= r.status_code < 500
            note = "" if ok else f"{endpoint}: {raw[:80]!r} -> {r.status_code} {r.text[:120]}"
        else:
            if rng.random() < 0.5:
                raw = b'{"messages": [{"role": "user", "content": "' + b"x" * (2 * limit_bytes) + b'"}]}'
                want = 413
            else:
                raw, want = json.dumps({"messages": [{"role": "user", "content": "word " * 20_000}]}).encode(), 400
            try:
                r = client.post(soak.url + "/v1/chat/completions", content=raw,
                                headers={"Content-Type": "application/json"})
                status, ok = r.status_code, r.status_code == want
            except (httpx.WriteError, httpx.RemoteProtocolError):  # refused before the whole body was sent
                status, ok = None, want == 413
    except httpx.HTTPError as e:
        note = f"{type(e).__name__}: {e}"
    return Outcome(kind, status, ok, time.perf_counter() - start, note)


def run_level(soak: Soak, workers: int, duration_s: float, texts: list[str], seed: int, limit_bytes: int,
              max_requests: int | None = None) -> list[Outcome]:
    import httpx

    hostile = hostile_bodies()
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    deadline = time.monotonic() + duration_s

    def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < deadline and (max_requests is None or len(outcomes) < max_requests):
                outcome = run_request(soak, client, rng, texts, hostile, limit_bytes)
                with lock:
                    outcomes.append(outcome)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def wait_idle(server: Server, timeout_s: float = 60) -> None:
    """Until the server runs and queues no request (its gauges on /metrics)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = httpx.get(server.base_url + "/metrics", timeout=10).text
        except Exception:  # noqa: BLE001 - a busy server: try again
            time.sleep(0.5)
            continue
        running = [line for line in text.splitlines() if line.startswith("hybridspec:num_requests_running ")]
        waiting = [line for line in text.splitlines() if line.startswith("hybridspec:num_requests_waiting ")]
        if running and waiting and float(running[0].split()[1]) == 0 and float(waiting[0].split()[1]) == 0:
            return
        time.sleep(0.2)


def server_500s(server: Server) -> int:
    import httpx

    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("hybridspec:http_requests_total{") and 'status="500"' in line))


def summary(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    by_kind = Counter(o.kind for o in outcomes)
    ok = Counter(o.kind for o in outcomes if o.ok)
    normal = sorted(o.seconds for o in outcomes if o.kind == "normal" and o.ok)
    return {"requests": len(outcomes), "per_s": round(len(outcomes) / seconds, 2),
            "by_kind": dict(by_kind), "ok_by_kind": dict(ok), "answered_500": sum(o.status == 500 for o in outcomes),
            "normal_identical": ok["normal"], "normal": by_kind["normal"],
            "normal_median_s": round(statistics.median(normal), 3) if normal else None,
            "failures": [f"{o.kind} {o.status}: {o.note}" for o in outcomes if not o.ok][:20]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--duration-s", type=float, default=180.0, help="each level's")
    parser.add_argument("--max-requests", type=int, default=None, help="each level's, at most")
    parser.add_argument("--warmup-s", type=float, default=20.0,
                        help="after the references, the mix at the highest level for this long, before the RSS the "
                             "levels are compared with")
    parser.add_argument("--prompts", type=int, default=8, help="MT-Bench first turns the normal requests send")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prefix-cache-bytes", type=int, default=64 << 20,
                        help="the server's prefix cache (default 64 MiB: full after the warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the server's log here")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    if not HYBRIDSPEC_CLI.exists():
        parser.error(f"{HYBRIDSPEC_CLI} is missing (scripts/setup.sh makes it)")
    texts = prompts(args.prompts)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv_ = serve_argv(args.model, port, "soak", "suffix", 1) + ["--max-body-size", BODY_LIMIT,
                                                                 "--prefix-cache-bytes", str(args.prefix_cache_bytes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    result: dict[str, Any] = {"config": vars(args) | {"json": str(args.json), "log_dir": str(log_dir)},
                              "machine": machine_info(), "levels": {}}
    with Server(argv_, env, port, log_dir / "server.log") as server:
        try:
            server.wait_healthy(600)
        except MethodFailed as e:
            print(e, file=sys.stderr)
            return 1
        import httpx

        soak = Soak(server.base_url, "soak", args.max_tokens)
        with httpx.Client(timeout=120) as client:  # the references, alone (and the warm-up)
            for i, text in enumerate(texts):
                for api in ("chat", "responses"):
                    status, reply = soak.normal(client, i, text, api, False)
                    if status != 200:
                        print(f"the reference request failed: {status} {reply[:300]}", file=sys.stderr)
                        return 1
                    soak.references[(i, api)] = reply
            for endpoint, raw in hostile_bodies():  # the refusals' paths warmed too
                client.post(server.base_url + endpoint, content=raw)
        # and the server's working set at the busiest level: its batches' buffers, the allocator's arenas
        run_level(soak, max(levels), args.warmup_s, texts, args.seed - 1, 1 << 20)
        wait_idle(server)
        warm = tree_rss(server.proc.pid)
        result["rss_after_warmup_gib"] = round(warm / GIB, 3)
        limit_bytes = 1 << 20
        with Peaks(lambda: {"rss": tree_rss(server.proc.pid)}, 0.5) as peaks:
            for c in levels:
                t0 = time.perf_counter()
                outcomes = run_level(soak, c, args.duration_s, texts, args.seed + c, limit_bytes, args.max_requests)
                seconds = time.perf_counter() - t0
                wait_idle(server)
                level = summary(outcomes, seconds)
                level["rss_after_gib"] = round(tree_rss(server.proc.pid) / GIB, 3)
                result["levels"][str(c)] = level
                print(f"{c} workers: {level['requests']} requests in {seconds:.0f} s, {level['answered_500']} 500s, "
                      f"normal identical {level['normal_identical']}/{level['normal']}", file=sys.stderr, flush=True)
        time.sleep(1.0)
        wait_idle(server)
        after = tree_rss(server.proc.pid)
        try:  # refused unread: the server may close the connection before the client has sent it all
            status: int | None = httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                                            content=b"{" + b" " * (40 << 20) + b"}",
                                            headers={"Content-Type": "application/json"}).status_code
        except (httpx.WriteError, httpx.RemoteProtocolError):
            status = None
        time.sleep(1.0)
        result["refused_40mb"] = {"status": status,
                                  "rss_delta_mib": round((tree_rss(server.proc.pid) - after) / (1 << 20), 1)}
        result.update(rss_after_gib=round(after / GIB, 3), rss_peak_gib=round(peaks.peaks.get("rss", 0) / GIB, 3),
                      rss_growth=round(after / warm - 1, 4), server_500s=server_500s(server),
                      healthy=httpx.get(server.base_url + "/health", timeout=10).status_code == 200)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    levels_ = result["levels"].values()
    result["targets"] = {
        "no_500": {"answered": sum(v["answered_500"] for v in levels_) + result["server_500s"], "pass":
                   result["server_500s"] == 0 and all(v["answered_500"] == 0 for v in levels_)},
        "normal_identical": {"pass": all(v["normal_identical"] == v["normal"] for v in levels_)},
        "every_request_as_expected": {"pass": all(not v["failures"] for v in levels_)},
        "memory_within_10pct": {"growth": result["rss_growth"], "pass": result["rss_growth"] <= MEMORY_TOLERANCE},
        "refused_40mb_within_100mib": {**result["refused_40mb"], "pass": result["refused_40mb"]["status"] in (413, None)
                                       and result["refused_40mb"]["rss_delta_mib"] < 100},
    }
    print_table(result)
    write_json(args.json, result)
    return 0 if all(t["pass"] for t in result["targets"].values()) else 2


def print_table(result: dict[str, Any]) -> None:
    print(f"{'workers':>7}  {'requests':>8}  {'req/s':>6}  {'normal ok':>10}  {'cancelled':>9}  {'hostile 4xx':>11}  "
          f"{'oversized':>9}  {'500s':>4}  {'normal s':>8}  {'RSS GiB':>7}")
    for c, v in result["levels"].items():
        k, ok = v["by_kind"], v["ok_by_kind"]

        def frac(kind: str) -> str:
            return f"{ok.get(kind, 0)}/{k.get(kind, 0)}"

        print(f"{c:>7}  {v['requests']:>8}  {v['per_s']:>6}  {frac('normal'):>10}  {frac('cancelled'):>9}  "
              f"{frac('hostile'):>11}  {frac('oversized'):>9}  {v['answered_500']:>4}  "
              f"{v['normal_median_s'] or 0:>8}  {v['rss_after_gib']:>7}")
        for failure in v["failures"][:5]:
            print(f"         failed: {failure}")
    print(f"RSS after warm-up {result['rss_after_warmup_gib']} GiB, after {result['rss_after_gib']} GiB "
          f"({result['rss_growth']:+.1%}), peak {result['rss_peak_gib']} GiB; server 500s {result['server_500s']}; "
          f"healthy {result['healthy']}; a refused 40 MB body: {result['refused_40mb']['status']}, RSS "
          f"{result['refused_40mb']['rss_delta_mib']:+} MiB")
    for name, t in result["targets"].items():
        print(f"target {name}: {'ok' if t['pass'] else 'MISS'}")


if __name__ == "__main__":
    sys.exit(main())
