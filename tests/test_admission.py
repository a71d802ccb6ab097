"""Admission control: a bounded number of running calls and KV, the rest waiting in arrival order, a bounded queue
(429 over HTTP), cancellation while waiting, and load: a burst larger than the limits with clients going away
mid-stream completes every accepted call exactly as it runs alone."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from hybridspec.errors import QueueFull
from hybridspec.model.target import TargetModel
from hybridspec.runtime.admission import Admission, Limits
from hybridspec.runtime.engine import Engine
from hybridspec.serve import create_app
from test_server import Server, metrics, sse

CHAT = "/v1/chat/completions"


# ------------------------------------------------------------------------------------------------ the queue alone


def wait_in_thread(admission: Admission, call, results: dict) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.__setitem__(call, admission.wait(call)), daemon=True)
    thread.start()
    return thread


def settle(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_calls_run_in_arrival_order_within_the_running_limit():
    admission = Admission(Limits(max_running=2, kv_budget_bytes=100, max_waiting=10))
    results: dict = {}
    for name in "abcd":
        admission.enqueue(name, 10)
    threads = {name: wait_in_thread(admission, name, results) for name in "dcba"}  # threads ask in reverse order
    settle(lambda: admission.running == 2)
    assert set(results) == {"a", "b"} and admission.waiting == 2  # arrival order, not the order threads asked
    admission.leave("b")
    settle(lambda: "c" in results)
    assert "d" not in results and admission.running == 2
    admission.leave("a")
    threads["d"].join(5)
    assert "d" in results and all(seconds >= 0 for seconds in results.values())


def test_the_kv_budget_holds_back_calls_and_a_call_alone_always_runs():
    admission = Admission(Limits(max_running=8, kv_budget_bytes=100, max_waiting=10))
    results: dict = {}
    admission.enqueue("huge", 500)  # more than the budget: it runs, alone
    admission.enqueue("small", 10)
    wait_in_thread(admission, "huge", results)
    wait_in_thread(admission, "small", results)
    settle(lambda: "huge" in results)
    time.sleep(0.05)
    assert "small" not in results and admission.kv_bytes == 500
    admission.leave("huge")
    settle(lambda: "small" in results)
    admission.hold("small", 60)  # its cache as made
    assert admission.kv_bytes == 60
    admission.enqueue("second", 50)  # 60 + 50 > 100: waits although a place is free
    wait_in_thread(admission, "second", results)
    time.sleep(0.05)
    assert "second" not in results
    admission.hold("small", 40)
    settle(lambda: "second" in results)


def test_the_queue_is_bounded_and_a_refusal_says_when_to_retry():
    admission = Admission(Limits(max_running=2, kv_budget_bytes=100, max_waiting=3))
    for i in range(5):  # two that run as soon as their threads ask, three waiting
        admission.enqueue(i, 1)
    with pytest.raises(QueueFull) as refused:
        admission.enqueue(5, 1)
    assert refused.value.retry_after >= 1 and "at most 3" in str(refused.value)
    assert admission.counters["refused"] == 1
    admission.leave(4)  # one waiting gives up: room for one more
    admission.enqueue(5, 1)


def test_a_call_cancelled_while_it_waits_never_runs():
    admission = Admission(Limits(max_running=1, kv_budget_bytes=100, max_waiting=10))
    results: dict = {}
    for name in ("running", "asleep", "not yet asking", "next"):
        admission.enqueue(name, 1)
    wait_in_thread(admission, "running", results)
    settle(lambda: "running" in results)
    sleeper = wait_in_thread(admission, "asleep", results)
    settle(lambda: admission.waiting == 3)
    admission.cancel("asleep")  # its thread is in wait: woken, with None
    admission.cancel("not yet asking")  # it leaves the line now; its wait returns None at once
    sleeper.join(5)
    assert results["asleep"] is None and admission.wait("not yet asking") is None
    wait_in_thread(admission, "next", results)
    time.sleep(0.05)
    assert "next" not in results  # still one running
    admission.leave("running")
    settle(lambda: results.get("next") is not None)
    assert admission.running == 1 and admission.waiting == 0 and admission.counters["cancelled_waiting"] == 2


def test_limits_are_checked_and_default_within_half_the_memory():
    with pytest.raises(ValueError, match="max_running"):
        Limits(max_running=0)
    from hybridspec.model.machine import memory_limit_bytes

    limits = Limits.default(prefix_cache_bytes=1 << 30)
    assert limits.kv_budget_bytes <= memory_limit_bytes() // 2
    assert Limits.default(0, max_running=3, kv_budget_bytes=123, max_waiting=0) == Limits(3, 123, 0)


# ------------------------------------------------------------------------------------------------ the engine


PROMPTS = [f"task {i}: " + "ls -la; cat setup.py; " * (2 + i % 3) for i in range(12)]


@pytest.fixture(scope="module")
def reference(tiny_model, tiny_tokenizer):
    """Each prompt alone, without speculation: what every accepted call must return."""
    engine = Engine(TargetModel(tiny_model), tiny_tokenizer, verify_cost=None)
    return {p: engine.generate(p, max_new_tokens=24, temperature=0, speculate="none").token_ids for p in PROMPTS}


class Watch:
    """Wraps an engine's step: the running calls and their KV at every step."""

    def __init__(self, engine: Engine):
        self.engine, self.running, self.kv = engine, [], []
        step = engine.step
        engine.scheduler._run_step = self  # the scheduler calls this instead

        def run(calls):
            self.running.append(len(engine._running))
            self.kv.append(sum(c.cache.nbytes for c in engine._running if c.cache is not None))
            step(calls)

        self._run = run

    def __call__(self, calls):
        self._run(calls)


def test_a_burst_beyond_the_limits_completes_every_accepted_call_as_alone(tiny_model, tiny_tokenizer, reference):
    target = TargetModel(tiny_model)
    one_call = 2 * target.kv_bytes_per_token * (max(map(len, PROMPTS)) + 24 + 64)
    engine = Engine(target, tiny_tokenizer, verify_cost=None, max_running_calls=3, kv_budget_bytes=3 * one_call,
                    max_waiting_calls=6, prefill_chunk=16)
    watch = Watch(engine)
    streams, refused = [], 0
    for prompt in PROMPTS:  # created at once, as a burst of requests: 3 run, 6 wait, the rest are refused
        try:
            streams.append((prompt, engine.stream(prompt, max_new_tokens=24, temperature=0, speculate="suffix")))
        except QueueFull:
            refused += 1
    assert refused == len(PROMPTS) - 9

    def consume(i: int):
        prompt, stream = streams[i]
        deltas = 0
        for _ in stream:
            deltas += 1
            if i % 4 == 1 and deltas == 2:  # this client goes away mid-stream
                stream.close()
                return prompt, None
        return prompt, stream.result

    with ThreadPoolExecutor(len(streams)) as pool:
        done = list(pool.map(consume, range(len(streams))))
    for prompt, result in done:
        if result is not None:
            assert result.token_ids == reference[prompt]
    assert sum(result is not None for _, result in done) == len(streams) - len(streams[1::4])
    assert max(watch.running) == 3 and max(watch.kv) <= 3 * one_call
    assert engine.admission.running == 0 and engine.admission.waiting == 0 and engine.admission.kv_bytes == 0
    assert all(c.cache is None for c in engine._running) and not engine._running


def test_a_stream_cancelled_while_waiting_never_runs(tiny_model, tiny_tokenizer, reference):
    engine = Engine(TargetModel(tiny_model), tiny_tokenizer, verify_cost=None, max_running_calls=1)
    first = engine.stream(PROMPTS[0], max_new_tokens=24, temperature=0, speculate="none")
    next(first)  # running
    waiting = engine.stream(PROMPTS[1], max_new_tokens=24, temperature=0, speculate="none")
    out: list = []
    thread = threading.Thread(target=lambda: out.append(list(waiting)), daemon=True)
    thread.start()
    settle(lambda: engine.admission.waiting == 1 and engine.admission._sleeping)
    waiting.cancel()
    thread.join(10)
    assert out == [[]] and waiting.result is None
    assert engine.stats.calls == 0 and waiting._call.cache is None and waiting._call.stats.steps == 0
    list(first)
    assert first.result.token_ids == reference[PROMPTS[0]] and engine.stats.calls == 1
    never_iterated = engine.stream(PROMPTS[2], max_new_tokens=4)
    never_iterated.close()  # gives its place up
    assert engine.admission.waiting == 0
    assert engine.generate(PROMPTS[3], max_new_tokens=24, temperature=0).token_ids == reference[PROMPTS[3]]


def test_a_running_call_cancelled_mid_prefill_leaves_at_its_next_step(tiny_model, tiny_tokenizer):
    engine = Engine(TargetModel(tiny_model), tiny_tokenizer, verify_cost=None, prefill_chunk=8)
    stream = engine.stream(PROMPTS[2] * 4, max_new_tokens=8, temperature=0)
    steps = engine.step
    passes = []

    def counted(calls):
        passes.append(len(calls))
        if len(passes) == 2:
            stream.cancel()  # from inside a step, as another thread would: the prompt is still pending
        steps(calls)

    engine.scheduler._run_step = counted
    assert list(stream) == [] and stream.result is None
    assert len(passes) == 2 and engine.admission.running == 0 and not engine._running


# ------------------------------------------------------------------------------------------------ over HTTP


@pytest.fixture(scope="module")
def busy_server(tiny_model, tiny_tokenizer):
    engine = Engine(TargetModel(tiny_model), tiny_tokenizer, verify_cost=None, max_running_calls=1,
                    max_waiting_calls=1, prefill_chunk=8)
    server = Server(create_app(engine, served_model_name="tiny"))
    yield server, engine
    server.stop()


def test_past_the_queue_the_server_answers_429_and_a_waiting_client_can_leave(busy_server):
    server, engine = busy_server
    body = {"messages": [{"role": "user", "content": PROMPTS[0] * 3}], "max_tokens": 400, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + CHAT, json=body) as running:
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # the role chunk: it is under way
            settle(lambda: engine.admission.running == 1)
            with http.stream("POST", server.url + CHAT, json=body):  # it waits
                settle(lambda: engine.admission.waiting == 1)
                assert metrics(server)[("hybridspec:num_requests_waiting", ())] == 1
                refused = http.post(server.url + CHAT, json={**body, "stream": False})
                assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
                error = refused.json()["error"]
                assert error["code"] == "rate_limit_exceeded" and "waiting" in error["message"]
                # the openai client sees its RateLimitError
                client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    client.chat.completions.create(model="tiny", messages=body["messages"], max_tokens=4)
            # the waiting client went away before its first token: it leaves the line and never runs
            settle(lambda: engine.admission.waiting == 0)
            calls = engine.stats.calls
            events = sse(list(lines))
            assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    settle(lambda: engine.admission.running == 0)
    assert engine.stats.calls == calls + 1  # the running one only
    after = metrics(server)
    assert after[("hybridspec:requests_refused_total", ())] == 2
    assert after[("hybridspec:num_requests_running", ())] == 0 and after[("hybridspec:kv_cache_usage_perc", ())] == 0
    assert after[("hybridspec:request_queue_time_seconds_count", ())] >= 1
    ok = httpx.post(server.url + CHAT, json={**body, "stream": False, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200


def test_serve_flags_are_checked_before_any_model_loads(capsys):
    import argparse

    from hybridspec.cli import main as cli_main
    from hybridspec.serve import parse_size

    assert parse_size("8G") == 8 << 30 and parse_size("512MiB") == 512 << 20 and parse_size("1024") == 1024
    for bad in ("lots", "0", "-1G"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
    for flag, value, message in (("--max-num-seqs", "0", "--max-num-seqs must be positive"),
                                 ("--max-waiting", "-1", "--max-waiting must be >= 0"),
                                 ("--threads", "0", "--threads must be positive")):
        with pytest.raises(SystemExit, match=message):
            cli_main(["serve", flag, value])
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--kv-cache-memory", "lots"])
    assert e.value.code == 2 and "not a size" in capsys.readouterr().err


_ARENAS = """
import ctypes, sys, threading
from hybridspec.model.machine import limit_allocator_arenas
if sys.argv[1] == "limit":
    assert limit_allocator_arenas(2)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
barrier = threading.Barrier(8)
def work():
    barrier.wait()  # all eight threads allocate while the others are alive
    libc.free(libc.malloc(1 << 16))
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
libc.malloc_stats()  # one "Arena N:" block per arena, on stderr
"""


def test_the_allocator_limit_keeps_new_threads_to_two_arenas():
    import subprocess
    import sys

    def arenas(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", _ARENAS, mode], capture_output=True, text=True, check=True)
        return run.stderr.count("Arena ")

    assert arenas("limit") <= 2 < arenas("default")
