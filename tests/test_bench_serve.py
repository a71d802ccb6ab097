"""benchmarks/bench_serve.py: its own logic on cheap stand-ins (method selection, the run order and the agents'
trajectories, streamed replies, Prometheus counters and queue time, resident memory of a process tree, the server's
process group, the median of repeats, its ratios and targets, the plot, and main's wiring with stand-in runs), and one
small real run of `hybridspec serve` against the in-process engine (slow)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

import bench_serve
from agent_calls import AgentCall
from bench_serve import (GAUGE_NAMES, GIB, Peaks, Server, add_ratios, agent_trajectories, chat_call, counter_deltas,
                         free_port, median_run, own_rss, parse_counters, plot_load, process_table, run_order,
                         select_methods, targets, tree_rss)
from harness import CallRecord, MethodFailed, record, summarize


def calls(trajectories: int, per_trajectory: int) -> list[list[AgentCall]]:
    return [[AgentCall(f"SWE-agent__x/t{t}", i, [{"role": "user", "content": f"t{t} c{i}"}], [1] * (10 + i))
             for i in range(per_trajectory)] for t in range(trajectories)]


def test_methods_by_full_name_or_by_speculation():
    assert select_methods("suffix") == ["serve-suffix", "vllm-suffix", "vllm-plugin-suffix", "engine-suffix"]
    assert select_methods("suffix", no_vllm=True) == ["serve-suffix", "engine-suffix"]
    assert select_methods("vllm-ngram,serve-none") == ["serve-none", "vllm-ngram"]  # METHODS' order
    assert select_methods("vllm-none", no_vllm=True) == []
    with pytest.raises(ValueError, match="unknown method 'eagle'"):
        select_methods("eagle")
    # vLLM's configs are the agent-call replays' (harness.py's, as bench_agent_calls.py's)
    assert bench_serve.VLLM_SPECULATIVE_CONFIGS["suffix"] == {"method": "suffix"}
    assert bench_serve.VLLM_SPECULATIVE_CONFIGS["none"] is None
    assert bench_serve.vllm_server_env(plugin=True)["HYBRIDSPEC_VLLM"] == "suffix"
    assert "HYBRIDSPEC_VLLM" not in bench_serve.vllm_server_env(plugin=False)


def test_levels_run_in_rotated_rounds_and_agents_share_trajectories_only_where_too_few():
    order = run_order(["a", "b", "c"], [1, 4], repeats=2)
    assert order == [("a", 1, 0), ("b", 1, 0), ("c", 1, 0), ("b", 1, 1), ("c", 1, 1), ("a", 1, 1),
                     ("c", 4, 0), ("a", 4, 0), ("b", 4, 0), ("a", 4, 1), ("b", 4, 1), ("c", 4, 1)]
    firsts = [order[k][0] for k in range(0, len(order), 3)]
    assert sorted(firsts[:3]) == ["a", "b", "c"]  # every method goes first in turn, across levels too
    assert run_order(["a"], [1, 2, 4], repeats=1) == [("a", 1, 0), ("a", 2, 0), ("a", 4, 0)]

    trajectories = calls(3, 2)
    assert agent_trajectories(trajectories, 2) == trajectories[:2]  # an agent per trajectory
    assert agent_trajectories(trajectories, 5) == [trajectories[i] for i in (0, 1, 2, 0, 1)]  # round-robin
    assert agent_trajectories(trajectories, 1, every=True) == trajectories  # one agent replays them all
    assert agent_trajectories(trajectories, 5, every=True) == [trajectories[i] for i in (0, 1, 2, 0, 1)]


def test_a_streamed_reply_gives_text_usage_and_the_first_text_chunk_time():
    def chunk(content=None, finish=None, usage=None, role=None):
        choices = [] if usage else [SimpleNamespace(delta=SimpleNamespace(content=content, role=role),
                                                    finish_reason=finish)]
        return SimpleNamespace(choices=choices, usage=usage)

    sent = {}

    def create(**kwargs):
        sent.update(kwargs)
        yield chunk(content="", role="assistant")  # a role chunk: not the first token
        time.sleep(0.02)
        yield chunk(content="Hel")
        yield chunk(content="lo", finish="stop")
        yield chunk(usage=SimpleNamespace(prompt_tokens=11, completion_tokens=2))

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    call = calls(1, 2)[0][1]
    r = chat_call(client, "serve-suffix", call, 128)
    assert (r.output, r.new_tokens, r.server_prompt_tokens, r.prompt_tokens) == ("Hello", 2, 11, 11)
    assert r.finish_reason == "stop" and 0.02 <= r.ttft_s <= r.total_s
    assert sent["temperature"] == 0 and sent["max_tokens"] == 128 and sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True} and sent["messages"] == call.messages

    def no_usage(**kwargs):
        yield chunk(content="x", finish="stop")

    client.chat.completions.create = no_usage
    with pytest.raises(MethodFailed, match="without usage"):
        chat_call(client, "serve-suffix", call, 128)


PROMETHEUS = """\
# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 200.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 30.0
vllm:generation_tokens_total{engine="0",model_name="m"} 128.0
vllm:generation_tokens_total{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


def test_counters_are_summed_over_labels_and_their_deltas_derived():
    counters = parse_counters(PROMETHEUS)
    assert counters == {"vllm:spec_decode_num_drafts_total": 40.0, "vllm:spec_decode_num_draft_tokens_total": 200.0,
                        "vllm:spec_decode_num_accepted_tokens_total": 60.0,
                        "vllm:generation_tokens_total": 130.0}
    before = {"vllm:spec_decode_num_drafts_total": 10.0, "vllm:spec_decode_num_draft_tokens_total": 40.0,
              "vllm:generation_tokens_total": 8.0}
    deltas = counter_deltas(before, counters)
    assert deltas["spec_decode_num_drafts"] == 30 and deltas["generation_tokens"] == 122
    assert deltas["acceptance"] == round(60 / 160, 4) and deltas["accepted_per_draft"] == 2.0
    assert "prompt_pass_share" not in deltas  # vLLM has no such counters
    ours = parse_counters("hybridspec:prompt_pass_seconds_total 3.0\nhybridspec:decode_pass_seconds_total 5.0\n")
    share = counter_deltas({"hybridspec:prompt_pass_seconds_total": 1.0}, ours)["prompt_pass_share"]
    assert share == round(2 / 7, 4)  # 2 s of prompt passes and 5 of decode passes over the replay


QUEUE_BEFORE = """\
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 1.5
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 2.0
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 3.0
vllm:request_queue_time_seconds_created{engine="0",model_name="m"} 1.79e+09
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
hybridspec:num_requests_running 3.0
"""


def test_queue_time_is_the_mean_over_the_replay_and_absent_where_the_server_has_none():
    before = parse_counters(QUEUE_BEFORE)
    assert before == {"vllm:request_queue_time_seconds_sum": 1.5, "vllm:request_queue_time_seconds_count": 3.0}
    after = parse_counters(QUEUE_BEFORE.replace("_sum{engine=\"0\",model_name=\"m\"} 1.5",
                                                "_sum{engine=\"0\",model_name=\"m\"} 5.5")
                           .replace("_count{engine=\"0\",model_name=\"m\"} 3.0",
                                    "_count{engine=\"0\",model_name=\"m\"} 11.0"))
    assert counter_deltas(before, after)["queue_s"] == 0.5  # 4 s over 8 requests queued in between
    assert "queue_s" not in counter_deltas(before, before)  # no request in between
    assert "queue_s" not in counter_deltas({}, parse_counters(PROMETHEUS))  # today's server: no histogram
    assert parse_counters(QUEUE_BEFORE, GAUGE_NAMES) == {"vllm:num_requests_waiting": 5.0,
                                                         "vllm:kv_cache_usage_perc": 0.25,
                                                         "hybridspec:num_requests_running": 3.0}


def test_summaries_ratios_and_targets():
    def rec(method, t, i, text, tokens, total, ttft):
        return CallRecord(method, "SWE-agent", f"t{t}", i, 100, tokens, text, total, ttft, finish_reason="length",
                          server_prompt_tokens=100 if method != "serve-suffix" or i else 99)

    reference = {("t0", 0): "a", ("t0", 1): "b"}
    timings = {"engine-suffix": ("ab", (1.0, 1.0), (0.2, 0.4)), "serve-suffix": ("aB", (1.0, 1.5), (0.3, 0.3)),
               "vllm-none": ("ab", (2.0, 2.0), (0.1, 0.1)), "vllm-suffix": ("ab", (1.25, 1.25), (0.1, 0.1))}
    runs = {m: [rec(m, 0, i, texts[i], 10, totals[i], ttfts[i]) for i in range(2)]
            for m, (texts, totals, ttfts) in timings.items()}
    summaries = add_ratios({m: summarize(rs, reference, concurrency=1, wall_s=99.0) for m, rs in runs.items()})
    serve = summaries["serve-suffix"]
    assert serve["tok_s"] == 8.0 and serve["identical_calls"] == 1 and serve["compared_calls"] == 2  # summed times
    assert serve["prompt_token_mismatches"] == 1 and summaries["vllm-none"]["prompt_token_mismatches"] == 0
    assert serve["ttft_s"] == 0.3 and serve["vs_engine"] == 0.8 and serve["vs_best_vllm"] == 1.0  # best: vllm-suffix
    assert summaries["engine-suffix"]["vs_engine"] is None and summaries["vllm-none"]["vs_best_vllm"] == 0.625
    concurrent = summarize(runs["serve-suffix"], reference, wall_s=2.0, concurrency=4)
    assert concurrent["tok_s"] == 10.0 and concurrent["per_call_tok_s"] == 8.0  # over the wall time
    goals = targets({1: summaries})
    assert goals["serve_suffix_vs_engine_suffix@1"] == {"ratio": 0.8, "target": 0.95, "pass": False}
    assert goals["serve_suffix_vs_best_vllm@1"]["best_vllm"] == "vllm-suffix"
    assert goals["serve_suffix_vs_best_vllm@1"]["pass"]


FAKE_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # an engine core stand-in
    print("child", child.pid, flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/health": b"", "/metrics": b"hybridspec:generation_tokens_total 5.0\\n"}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_a_server_is_awaited_on_health_and_ended_with_its_process_group(tmp_path):
    import os

    port = free_port()
    server = Server([sys.executable, "-c", FAKE_SERVER, str(port)], dict(os.environ), port, tmp_path / "s.log")
    try:
        assert server.wait_healthy(30) < 30
        assert server.metrics() == {"hybridspec:generation_tokens_total": 5.0}
        child = int(server.log_tail().split()[1])
    finally:
        server.close()
    assert server.proc.poll() is not None
    with pytest.raises(ProcessLookupError):  # the group went with it
        for _ in range(50):
            os.kill(child, 0)
            time.sleep(0.1)

    dead = Server([sys.executable, "-c", "import sys; print('bad config'); sys.exit(3)"], dict(os.environ), port,
                  tmp_path / "d.log")
    with pytest.raises(MethodFailed, match="(?s)exited \\(3\\).*bad config"):
        dead.wait_healthy(30)
    dead.close()


TREE = textwrap.dedent("""
    import subprocess, sys, time
    held = bytearray(64 << 20)  # resident: bytearray writes its zeros
    if sys.argv[1] == "parent":
        child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "child", sys.argv[2]])
        print(child.pid, flush=True)
    else:
        held += bytearray(64 << 20)
        print("ready", flush=True)
    time.sleep(600)
""")


def test_resident_memory_is_summed_over_a_process_tree_and_its_peak_sampled():
    parent = subprocess.Popen([sys.executable, "-c", TREE, "parent", TREE], stdout=subprocess.PIPE, text=True)
    try:
        lines = [parent.stdout.readline().strip() for _ in range(2)]  # the parent's child pid, the child's "ready"
        assert "ready" in lines
        child = int(next(line for line in lines if line.isdigit()))
        table = process_table()
        assert table[child][0] == parent.pid and table[parent.pid][0] == os.getpid()
        assert tree_rss(parent.pid, table) == table[parent.pid][1] + table[child][1]  # the child counts in its tree
        assert table[parent.pid][1] > 64 << 20 and table[child][1] > 128 << 20
        assert tree_rss(os.getpid(), table) > tree_rss(parent.pid, table) and own_rss() > 0
    finally:
        parent.kill()
        parent.wait()
    assert tree_rss(parent.pid) == 0  # gone: nothing of it left to count
    assert tree_rss(1, {1: (0, 10), 2: (1, 5), 3: (2, 7), 4: (0, 100)}) == 22  # the whole subtree, no stranger

    values = iter([1.0, 5.0, 3.0] + [2.0] * 1000)
    with Peaks(lambda: {"rss": next(values)}, 0.01) as peaks:
        time.sleep(0.2)
    assert peaks.peaks == {"rss": 5.0}
    with Peaks(lambda: {}, 0.01) as nothing:  # a server without the gauges
        pass
    assert nothing.peaks == {}


def test_repeats_report_the_median_run_and_the_spread():
    def run(wall_s):
        return {"records": [record("m", calls(1, 1)[0][0], "x", wall_s, 0.1, new_tokens=10)], "wall_s": wall_s,
                "tag": wall_s}

    chosen = median_run([run(1.0), run(4.0), run(2.0)], concurrency=4)
    assert chosen["tag"] == 2.0 and chosen["tok_s_runs"] == [10.0, 2.5, 5.0] and chosen["tok_s_spread"] == 1.5
    assert median_run([run(1.0), run(2.0)], concurrency=4)["tag"] == 2.0  # the lower middle: a run that happened
    single = median_run([run(2.0)], concurrency=1)
    assert single["tok_s_runs"] == [5.0] and single["tok_s_spread"] is None


def test_the_plot_of_tok_s_against_concurrency_is_written(tmp_path):
    levels = {c: {"serve-suffix": {"tok_s": 10.0 * c ** 0.5, "tok_s_runs": [9.0 * c ** 0.5, 10.0 * c ** 0.5]},
                  "vllm-ngram": {"tok_s": 8.0 * c ** 0.5}} for c in (1, 4, 16, 64)}
    levels[64].pop("vllm-ngram")  # a method that did not run at a level: no point there
    png = plot_load(tmp_path / "sub" / "load.png", levels, "test")
    assert png == tmp_path / "sub" / "load.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_runs_every_level_and_repeat_and_reports_queue_memory_and_the_plot(tmp_path, monkeypatch, capsys):
    trajectories = calls(2, 2)
    ran: list[tuple[str, int, int]] = []

    def records(name, agents, seconds):
        return [record(name, call, "same" if name != "serve-none" or call.index else "other", seconds, seconds / 2,
                       new_tokens=10, server_prompt_tokens=len(call.prompt_token_ids))
                for agent in agents for call in agent]

    class FakeInProcess:
        def __init__(self, *args):
            pass

        def run(self, method, agents, concurrency, max_tokens, warmup):
            ran.append((method.name, concurrency, len(agents)))
            return {"records": records(method.name, agents, 1.0), "wall_s": 1.0, "load_s": None, "server": {},
                    "peak_rss": 2 * GIB, "peaks": {}}

    def fake_http(method, args, model_dir, agents, concurrency, log_dir, warmup, tag):
        ran.append((method.name, concurrency, len(agents)))
        if method.name == "vllm-none":
            raise MethodFailed("no vLLM here\nmore")
        wall = {"r0": 2.0, "r1": 1.0, "r2": 4.0}[tag.split("-")[1]]  # at 4 agents: 80 tokens in each
        return {"records": records(method.name, agents, wall), "wall_s": wall, "load_s": 3.14,
                "server": {"queue_s": 0.25 * concurrency} if method.name == "serve-suffix" else {},
                "peak_rss": GIB * concurrency, "peaks": {"num_requests_waiting": 1.0}}

    monkeypatch.setattr(bench_serve, "load_replay", lambda *a: (tmp_path, None, trajectories))
    monkeypatch.setattr(bench_serve, "warmup_call", lambda tokenizer: None)
    monkeypatch.setattr(bench_serve, "InProcess", FakeInProcess)
    monkeypatch.setattr(bench_serve, "run_http", fake_http)
    out = tmp_path / "bs.json"
    assert bench_serve.main(["--methods", "serve-none,serve-suffix,vllm-none", "--concurrency", "1,4",
                             "--repeats", "3", "--json", str(out)]) == 0
    assert ran[0] == ("engine-none", 1, 2)  # the reference first: every trajectory, one agent
    assert ran.count(("vllm-none", 1, 1)) == 1  # failed once: not tried again at that level
    assert ran.count(("serve-suffix", 4, 4)) == 3  # four agents sharing the two trajectories, three repeats
    result = json.loads(out.read_text())
    assert result["config"]["trajectories"] == 4  # the default: the highest concurrency
    assert set(result["not_run"]) == {"vllm-none@1", "vllm-none@4"}
    at4 = result["workloads"]["overall"]["concurrency-4"]
    assert set(at4) == {"serve-none", "serve-suffix"}
    suffix = at4["serve-suffix"]
    assert suffix["tok_s"] == 40.0 and suffix["tok_s_runs"] == [40.0, 80.0, 20.0] and suffix["tok_s_spread"] == 1.5
    assert suffix["server"]["queue_s"] == 1.0 and suffix["peak_rss_gib"] == 4.0 and suffix["load_s"] == 3.1
    assert suffix["peaks"] == {"num_requests_waiting": 1.0} and suffix["identical_calls"] == 8
    assert at4["serve-none"]["identical_calls"] == 4 and at4["serve-none"]["vs_best_vllm"] is None
    assert result["workloads"]["overall"]["concurrency-1"]["serve-suffix"]["calls"] == 2
    assert result["vllm"]["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "tok/s by concurrency" in printed and "not run: vllm-none@1: no vLLM here" in printed


@pytest.mark.slow
def test_a_small_run_of_hybridspec_serve_against_the_engine(tmp_path, capsys):
    if not bench_serve.HYBRIDSPEC_CLI.exists():
        pytest.skip("no .venv/bin/hybridspec")
    out = tmp_path / "bench_serve.json"
    assert bench_serve.main(["--no-vllm", "--trajectories", "1", "--calls-per-trajectory", "2", "--methods", "suffix",
                             "--concurrency", "1", "--max-tokens", "32", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["not_run"] == {}
    assert set(result["workloads"]) == {"overall", "SWE-agent"}  # per framework too, at concurrency 1
    level = result["workloads"]["overall"]["concurrency-1"]
    assert set(level) == {"serve-suffix", "engine-suffix"}  # the reference (engine-none) runs apart
    for name, s in level.items():
        assert s["calls"] == 2 and s["tok_s"] > 0 and s["ttft_s"] is not None, name
        assert s["identical_calls"] == 2, name  # greedy: the same text over HTTP as in process
        assert s.get("prompt_token_mismatches") == (0 if name == "serve-suffix" else None), name  # servers count
    server = level["serve-suffix"]["server"]
    assert server.get("generation_tokens") == level["serve-suffix"]["new_tokens"]
    assert level["serve-suffix"]["peak_rss_gib"] > 0.1 and level["engine-suffix"]["peak_rss_gib"] > 0.1
    assert level["engine-suffix"]["tokens_per_step"] >= 1 and "engine" in level["engine-suffix"]
    assert result["outputs_compared"] == "text" and result["reference"] == "engine-none"
    assert "serve_suffix_vs_engine_suffix@1" in result["targets"]
    assert "serve-suffix" in capsys.readouterr().out
    assert out.with_suffix(".png").stat().st_size > 0  # tok/s against concurrency


def test_runs_merge_into_one_table_of_levels_with_the_issues_targets_and_one_plot(tmp_path, capsys):
    def run(path, config, levels):
        path.write_text(json.dumps({"config": config, "workloads": {"overall": {
            f"concurrency-{c}": {m: {"tok_s": tok_s, "ttft_s": ttft} for m, (tok_s, ttft) in table.items()}
            for c, table in levels.items()}}}))
        return path

    two = {"trajectories": 4, "calls_per_trajectory": 2, "max_tokens": 128, "threads": 1}
    a = run(tmp_path / "a.json", two, {1: {"serve-none": (10.0, 1.0), "serve-suffix": (12.0, 1.0)},
                                       4: {"serve-none": (20.0, 2.0), "serve-suffix": (27.0, 2.0),
                                           "vllm-ngram": (25.0, 3.0)}})
    b = run(tmp_path / "b.json", {**two, "trajectories": 64, "calls_per_trajectory": 1},
            {64: {"serve-none": (30.0, 9.0), "serve-suffix": (31.0, 10.0), "serve-suffix+peagle": (29.0, 12.0),
                  "vllm-none": (32.0, 8.0)}})
    c = run(tmp_path / "c.json", two, {4: {"vllm-suffix": (26.0, 1.5)}})  # another method at a level already run
    levels, workloads = bench_serve.merge_levels([a, b, c])
    assert list(levels) == [1, 4, 64] and set(levels[4]) == {"serve-none", "serve-suffix", "vllm-ngram", "vllm-suffix"}
    assert workloads[4]["sources"] == [str(a), str(c)] and workloads[64]["calls_per_trajectory"] == 1
    goals = targets(levels)
    assert goals["serve_suffix_vs_none@1"] == {"ratio": 1.2, "target": 1.3, "pass": False}  # 1.3x at one and four
    assert goals["serve_suffix_vs_none@64"]["target"] == 1.0 and goals["serve_suffix_vs_none@64"]["pass"]
    assert goals["serve_suffix_vs_best_vllm@4"]["best_vllm"] == "vllm-suffix"  # 26 over vllm-ngram's 25
    assert goals["serve_suffix_ttft_vs_best_vllm@4"]["ratio"] == 0.75  # vllm-suffix's 1.5 s over our 2.0 s
    assert not goals["serve_suffix+peagle_vs_none@64"]["pass"] and not goals["serve_suffix_vs_best_vllm@64"]["pass"]
    assert "serve_suffix_vs_best_vllm@1" not in goals  # no vLLM at that level

    other = run(tmp_path / "d.json", {**two, "max_tokens": 64}, {4: {"vllm-none": (1.0, 1.0)}})
    with pytest.raises(ValueError, match="not the same calls"):
        bench_serve.merge_levels([a, other])
    every = run(tmp_path / "e.json", {**two, "every_trajectory": True}, {4: {"vllm-none": (1.0, 1.0)}})
    with pytest.raises(ValueError, match="not the same calls"):  # one agent per trajectory vs all of them
        bench_serve.merge_levels([a, every])
    out = tmp_path / "merged.json"
    assert bench_serve.main(["--merge", str(a), str(b), str(c), "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["levels"]["concurrency-64"]["vllm-none"]["tok_s"] == 32.0
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "median seconds to the first token" in printed and "serve_suffix_vs_none@4: 1.35x >= 1.30x: ok" in printed
    assert bench_serve.main(["--merge", str(a), str(other)]) == 2
