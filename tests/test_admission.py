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


def settle(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def admit_all(admission: Admission) -> list:
    """What the engine's loop admits now: the calls in line that fit, first come first."""
    admitted = []
    while (call := admission.admit()) is not None:
        admitted.append(call[0])
        assert call[1] >= 0  # the seconds it waited
    return admitted


def test_calls_run_in_arrival_order_within_the_running_limit():
    admission = Admission(Limits(max_num_seqs=2, kv_cache_memory=100, max_waiting=10))
    for name in "abcd":
        admission.enqueue(name, 10)
    assert admit_all(admission) == ["a", "b"] and admission.waiting == 2 and admission.running == 2
    admission.leave("b")
    assert admit_all(admission) == ["c"] and admission.running == 2
    admission.leave("a")
    assert admit_all(admission) == ["d"]


def test_the_kv_budget_holds_back_calls_and_a_call_alone_always_runs():
    admission = Admission(Limits(max_num_seqs=8, kv_cache_memory=100, max_waiting=10))
    admission.enqueue("huge", 500)  # more than the budget: it runs, alone
    admission.enqueue("small", 10)
    assert admit_all(admission) == ["huge"] and admission.kv_bytes == 500  # the first in line holds back the rest
    admission.leave("huge")
    assert admit_all(admission) == ["small"]
    admission.hold("small", 60)  # its cache as made
    assert admission.kv_bytes == 60
    admission.enqueue("second", 50)  # 60 + 50 > 100: waits although a place is free
    assert admit_all(admission) == []
    admission.hold("small", 40)
    assert admit_all(admission) == ["second"]


def test_the_queue_is_bounded_and_a_refusal_says_when_to_retry():
    admission = Admission(Limits(max_num_seqs=2, kv_cache_memory=100, max_waiting=3))
    for i in range(5):  # two that run as soon as the loop admits them, three waiting
        admission.enqueue(i, 1)
    with pytest.raises(QueueFull) as refused:
        admission.enqueue(5, 1)
    assert refused.value.retry_after >= 1 and "at most 3" in str(refused.value)
    assert admission.counters["refused"] == 1
    admission.drop(4)  # one waiting gives up: room for one more
    admission.enqueue(5, 1)


def test_a_call_dropped_while_it_waits_never_runs():
    admission = Admission(Limits(max_num_seqs=1, kv_cache_memory=100, max_waiting=10))
    for name in ("running", "gone", "next"):
        admission.enqueue(name, 1)
    assert admit_all(admission) == ["running"]
    admission.drop("gone")
    admission.drop("running")  # not waiting: nothing to drop
    assert admit_all(admission) == [] and admission.waiting_calls() == ["next"]
    admission.leave("running")
    assert admit_all(admission) == ["next"]
    assert admission.running == 1 and admission.waiting == 0 and admission.counters["cancelled_waiting"] == 1


def test_limits_are_checked_and_default_within_half_the_memory():
    with pytest.raises(ValueError, match="max_num_seqs"):
        Limits(max_num_seqs=0)
    from hybridspec.model.machine import memory_limit_bytes

    limits = Limits.default(prefix_cache_bytes=1 << 30)
    assert limits.kv_cache_memory <= memory_limit_bytes() // 2
    assert Limits.default(0, max_num_seqs=3, kv_cache_memory=123, max_waiting=0) == Limits(3, 123, 0)


# ------------------------------------------------------------------------------------------------ the engine


PROMPTS = [f"task {i}: " + "ls -la; cat setup.py; " * (2 + i % 3) for i in range(12)]


@pytest.fixture(scope="module")
def reference(tiny_model, tiny_tokenizer):
    """Each prompt alone, without speculation: what every accepted call must return."""
    engine = Engine(TargetModel(tiny_model), tiny_tokenizer, verify_cost=None)
    return {p: engine.generate(p, max_new_tokens=24, temperature=0, speculate="none").token_ids for p in PROMPTS}


class Watch:
    """Wraps an engine's step (its loop's `run_step`): the running calls and their KV at every step."""

    def __init__(self, engine: Engine):
        self.engine, self.running, self.kv = engine, [], []
        self.step = engine.loop.run_step
        engine.loop.run_step = self

    def __call__(self, plan):
        running = self.engine.loop.running
        self.running.append(len(running))
        self.kv.append(sum(c.cache.nbytes for c in running if c.cache is not None))
        return self.step(plan)


def test_a_burst_beyond_the_limits_completes_every_accepted_call_as_alone(tiny_model, tiny_tokenizer, reference):
    target = TargetModel(tiny_model)
    one_call = 2 * target.kv_bytes_per_token * (max(map(len, PROMPTS)) + 24 + 64)
    engine = Engine(target, tiny_tokenizer, verify_cost=None, max_num_seqs=3, kv_cache_memory=3 * one_call,
                    max_waiting=6, prefill_chunk=16)
    watch = Watch(engine)
    streams, refused = [], 0
    with engine.loop.paused():  # created at once, as a burst of requests: 3 run, 6 wait, the rest are refused
        for prompt in PROMPTS:
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
    settle(lambda: not engine.loop.running)
    assert engine.admission.running == 0 and engine.admission.waiting == 0 and engine.admission.kv_bytes == 0


def test_a_stream_cancelled_while_waiting_never_runs(tiny_model, tiny_tokenizer, reference):
    engine = Engine(TargetModel(tiny_model), tiny_tokenizer, verify_cost=None, max_num_seqs=1)
    first = engine.stream(PROMPTS[0], max_new_tokens=24, temperature=0, speculate="none")
    next(first)  # running
    with engine.loop.paused():  # the first call cannot end (and let the second in) before the second is cancelled
        assert not first.ended
        waiting = engine.stream(PROMPTS[1], max_new_tokens=24, temperature=0, speculate="none")
        out: list = []
        thread = threading.Thread(target=lambda: out.append(list(waiting)), daemon=True)
        thread.start()
        assert engine.admission.waiting == 1
        waiting.cancel()
    thread.join(10)
    assert out == [[]] and waiting.result is None and waiting.ended
    assert engine.stats.calls == 0 and engine.admission.waiting == 0  # it never began
    list(first)
    assert first.result.token_ids == reference[PROMPTS[0]] and engine.stats.calls == 1
    never_iterated = engine.stream(PROMPTS[2], max_new_tokens=4)
    never_iterated.close()  # gives its place up, and returns once it has
    assert never_iterated.ended and engine.admission.waiting == 0 and engine.admission.running == 0
    assert engine.generate(PROMPTS[3], max_new_tokens=24, temperature=0).token_ids == reference[PROMPTS[3]]


def test_a_running_call_cancelled_mid_prefill_leaves_at_its_next_step(tiny_model, tiny_tokenizer):
    engine = Engine(TargetModel(tiny_model), tiny_tokenizer, verify_cost=None, prefill_chunk=8)
    steps = engine.loop.run_step
    passes = []

    def counted(plan):
        passes.append(len(plan.calls))
        if len(passes) == 2:
            stream.cancel()  # from inside a step, as another thread would: the prompt is still pending
        return steps(plan)

    with engine.loop.paused():
        stream = engine.stream(PROMPTS[2] * 4, max_new_tokens=8, temperature=0)
        engine.loop.run_step = counted
    assert list(stream) == [] and stream.result is None
    assert len(passes) == 2 and engine.admission.running == 0
    settle(lambda: not engine.loop.running)


def test_the_caller_never_lends_its_thread_and_a_dropped_handle_cancels_its_call(tiny_model, tiny_tokenizer):
    """Every step runs on the engine's loop thread, whoever waits for it; a handle its caller drops is a cancel."""
    engine = Engine(TargetModel(tiny_model), tiny_tokenizer, verify_cost=None, prefill_chunk=8)
    steps, threads = engine.loop.run_step, set()

    def recorded(plan):
        threads.add(threading.current_thread().name)
        return steps(plan)

    engine.loop.run_step = recorded
    engine.generate(PROMPTS[0], max_new_tokens=8)
    for _ in engine.stream(PROMPTS[1], max_new_tokens=8):
        pass
    assert threads == {"hybridspec-engine"}
    with engine.loop.paused():
        engine.stream(PROMPTS[2] * 4, max_new_tokens=400)  # dropped before it began: it never does
    settle(lambda: engine.admission.waiting == 0)
    assert engine.stats.calls == 2
    stream = engine.stream(PROMPTS[2], max_new_tokens=400)
    next(stream)
    del stream  # dropped while it runs: it leaves before the next step
    settle(lambda: engine.admission.running == 0 and not engine.loop.running)
    assert engine.stats.calls == 3 and engine.stats.new_tokens < 16 + 400


_TEAMS = """
import os, time
import torch
from hybridspec.model.target import TargetModel
from hybridspec.runtime.engine import Engine
from hybridspec.tools.testing import tiny_llama, tiny_tokenizer
torch.set_num_threads(2)
engine = Engine(TargetModel(tiny_llama()), tiny_tokenizer(128), verify_cost=None)

def threads_settled():  # this process's threads once the loop thread (and its team) has gone
    assert engine.loop.wait_idle(10)
    time.sleep(0.2)
    return len(os.listdir("/proc/self/task"))

engine.generate("warm up", max_new_tokens=4)
alone = threads_settled()
torch.ones(1 << 22).add_(1)  # a parallel region of this thread's own: its team keeps a worker
with_team = len(os.listdir("/proc/self/task"))
engine.generate("a call", max_new_tokens=4)
print(alone, with_team, threads_settled())
"""


def test_a_caller_hands_the_loop_a_call_without_an_openmp_team_of_its_own():
    """libgomp spins its waiting workers only while it manages no more threads than there are CPUs: a caller's idle
    team beside the loop's would make every step's parallel regions wake their workers through the kernel. A caller
    that submits a call ends its team (`release_openmp_threads`)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _TEAMS], capture_output=True, text=True, check=True, timeout=300)
    alone, with_team, after = map(int, run.stdout.split())
    assert with_team == alone + 1  # the caller's worker
    assert after == alone


# ------------------------------------------------------------------------------------------------ over HTTP


@pytest.fixture(scope="module")
def busy_server(tiny_model, tiny_tokenizer):
    engine = Engine(TargetModel(tiny_model), tiny_tokenizer, verify_cost=None, max_num_seqs=1,
                    max_waiting=1, prefill_chunk=8)
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
                                 ("--threads", "0", "--threads must be positive"),
                                 ("--max-tokens", "0", "--max-tokens: max_new_tokens must be a positive integer"),
                                 ("--speculate", "eagle", "--speculate: speculate must be one of")):
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
