"""benchmarks/bench_serve.py: its own logic on cheap stand-ins (method selection, streamed replies, Prometheus
counters, the server's process group, its ratios and targets), and one small real run of `hybridspec serve` against
the in-process engine (slow)."""
from __future__ import annotations

import json
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

import bench_serve
from agent_calls import AgentCall
from bench_serve import (Server, add_ratios, chat_call, counter_deltas, free_port, parse_counters, select_methods,
                         targets)
from harness import CallRecord, MethodFailed, summarize


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
    assert set(level) == {"serve-suffix", "engine-suffix", "engine-none"}
    for name, s in level.items():
        assert s["calls"] == 2 and s["tok_s"] > 0 and s["ttft_s"] is not None, name
        assert s["identical_calls"] == 2, name  # greedy: the same text over HTTP as in process
        assert s.get("prompt_token_mismatches") == (0 if name == "serve-suffix" else None), name  # servers count
    server = level["serve-suffix"]["server"]
    assert server.get("generation_tokens") == level["serve-suffix"]["new_tokens"]
    assert level["engine-suffix"]["tokens_per_step"] >= 1 and "engine" in level["engine-suffix"]
    assert result["outputs_compared"] == "text" and result["reference"] == "engine-none"
    assert "serve_suffix_vs_engine_suffix@1" in result["targets"]
    assert "serve-suffix" in capsys.readouterr().out
    assert out.with_suffix(".png").stat().st_size > 0  # the bars by method
