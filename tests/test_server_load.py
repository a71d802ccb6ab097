"""A burst of real agent prompts beyond the server's limits, on `hybridspec serve` with SmolLM2 (a subprocess, on
loopback): it accepts as many as may run and wait, answers the rest 429, completes every accepted request (clients
that go away mid-stream aside) with the text each gets alone, never runs more than its limit at once, and keeps its
resident memory within the budget it was given."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hybridspec.runtime.admission import STEP_RESERVE_BYTES
from test_server_agent import metrics, serve

pytestmark = pytest.mark.slow

RUNNING, WAITING, KV, PREFIX = 3, 6, 160 << 20, 64 << 20
BURST = 12


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--threads", "1", "--max-num-seqs", str(RUNNING), "--max-waiting", str(WAITING), "--kv-cache-memory",
            str(KV), "--prefix-cache-bytes", str(PREFIX), "--max-tokens", "24"]
    with serve(args, tmp_path_factory.mktemp("serve") / "serve.log") as server:
        yield server


@pytest.fixture(scope="module")
def prompts():
    """The ends of real agent calls (about 700 tokens each) as text prompts."""
    from agent_calls import load_agent_calls
    from hybridspec.model.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    calls = [c for calls in load_agent_calls(tokenizer, trajectories=BURST, calls_per_trajectory=1) for c in calls]
    return [tokenizer.decode(c.prompt_token_ids[-700:], skip_special_tokens=True) for c in calls[:BURST]]


def test_a_burst_beyond_the_limits(server, prompts):
    url, pid = server
    body = {"model": "smollm2", "max_tokens": 24, "temperature": 0}
    assert httpx.post(url + "/v1/completions", json={**body, "prompt": "warm up"}, timeout=120).status_code == 200
    baseline, peak, gauges, sampling = rss(pid), [0], [], threading.Event()

    def sample():
        while not sampling.is_set():
            peak[0] = max(peak[0], rss(pid))
            m = metrics(url)
            gauges.append((m[("hybridspec:num_requests_running", ())], m[("hybridspec:kv_cache_usage_perc", ())]))
            time.sleep(0.1)

    def request(i: int):
        """Streamed; every third client goes away after two chunks. (status, text or None)"""
        with httpx.stream("POST", url + "/v1/completions", json={**body, "prompt": prompts[i], "stream": True},
                          timeout=600) as response:
            if response.status_code != 200:
                response.read()
                return response.status_code, response.json(), response.headers.get("retry-after")
            text, chunks = "", 0
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                if i % 3 == 2 and chunks == 2:
                    return 200, None, None  # gone
                choices = json.loads(line[6:])["choices"]
                text += choices[0]["text"] if choices else ""
            return 200, text, None

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(request, range(BURST)))
    sampling.set()
    sampler.join()
    refused = [a for a in answers if a[0] == 429]
    assert 1 <= len(refused) <= BURST - RUNNING - WAITING + 1 and len(refused) + sum(a[0] == 200 for a in answers) \
        == BURST
    assert all(a[1]["error"]["code"] == "rate_limit_exceeded" and int(a[2]) >= 1 for a in refused)
    assert max(running for running, _ in gauges) <= RUNNING and max(kv for _, kv in gauges) <= 1.0
    assert peak[0] <= baseline + KV + PREFIX + STEP_RESERVE_BYTES, (peak[0] - baseline) / 2**20
    for i, (status, text, _) in enumerate(answers):
        if status == 200 and text is not None:  # every accepted, completed request: as it runs alone
            alone = httpx.post(url + "/v1/completions", json={**body, "prompt": prompts[i]}, timeout=300)
            assert alone.json()["choices"][0]["text"] == text
    after = metrics(url)
    assert after[("hybridspec:num_requests_running", ())] == 0 and after[("hybridspec:num_requests_waiting", ())] == 0
    assert after[("hybridspec:requests_refused_total", ())] == len(refused)
