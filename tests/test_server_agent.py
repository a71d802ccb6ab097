"""An unmodified agent framework on `hybridspec serve`: mini-swe-agent 2.4.6's `mini` command (through litellm's
OpenAI-compatible route) against the server on the real SmolLM2, in a throwaway git repository with a step limit.
With its default, tool-calling config (mini.yaml + examples/mini-swe-agent.yaml) the agent solves and submits a task
it is told the command of. With its text-based config (examples/mini-swe-agent-textbased.yaml), where SmolLM2-135M
rarely follows the format, the calls are checked, not the outcome: every one succeeded through the server (the
server counted exactly that many, none answered 4xx/5xx), and the agent's re-sent conversation hit the prefix cache
and was drafted by the suffix cache (/metrics)."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the virtual environment running the tests: hybridspec, mini
TASK = "greet.py should end the greeting with an exclamation mark. Fix it, then submit."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(args: list[str], log_path: Path) -> Iterator[tuple[str, int]]:
    """`hybridspec serve` with `args` as a subprocess on a free port, once /health answers: (its URL, its pid)."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(BIN / "hybridspec"), "serve", "--port", str(port), *args], stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"the server exited:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"the server did not start:\n{log_path.read_text()}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`hybridspec serve` (SmolLM2, suffix speculation) as a subprocess on a free port."""
    with serve([], tmp_path_factory.mktemp("serve") / "serve.log") as (url, _):
        yield url


def metrics(url: str) -> dict[tuple, float]:
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def run_mini(server: str, tmp_path: Path, configs: list[str], task: str, step_limit: int) -> tuple[Path, dict]:
    """mini-swe-agent's `mini` with `configs` (its own by name, ours by path) on the server, in a throwaway git
    repository holding greet.py; the repository and the trajectory's info."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "greet.py").write_text('def greet(name):\n    return "Hello " + name\n')
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run(git + args, cwd=repo, check=True)
    env = {**os.environ, "MSWEA_CONFIGURED": "true", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "config")}
    trajectory = tmp_path / "run.traj.json"
    argv = [str(BIN / "mini")] + [a for c in configs for a in ("-c", c)]
    run = subprocess.run(
        argv + ["-c", f"model.model_kwargs.api_base={server}/v1", "-c", f"agent.step_limit={step_limit}",
                "-y", "--exit-immediately", "-t", task, "-o", str(trajectory)],
        cwd=repo, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return repo, json.loads(trajectory.read_text())["info"]


def test_mini_swe_agent_runs_on_the_server(server, tmp_path):
    _, info = run_mini(server, tmp_path, ["mini_textbased.yaml", str(ROOT / "examples" /
                                                                      "mini-swe-agent-textbased.yaml")], TASK, 3)
    # a normal end: the step limit, the agent's own format-error limit, or a submission; not an exception
    assert info["exit_status"] in ("LimitsExceeded", "RepeatedFormatError", "Submitted"), info
    calls = info["model_stats"]["api_calls"]
    assert 1 <= calls <= 3

    m = metrics(server)
    chat = "/v1/chat/completions"
    http = {labels: v for (name, labels), v in m.items() if name == "hybridspec:http_requests_total"}
    assert http[(("endpoint", chat), ("status", "200"))] == calls
    assert all(dict(labels)["status"].startswith("2") for labels in http), http  # no 4xx / 5xx at all
    finished = sum(v for (name, labels), v in m.items()
                   if name == "hybridspec:requests_total" and dict(labels)["endpoint"] == chat)
    assert finished == calls and m.get(("hybridspec:requests_total", (("endpoint", chat), ("finish_reason",
                                                                                          "abort"))), 0) == 0
    assert m[("hybridspec:prefix_cache_hit_tokens_total", ())] > 0  # each call re-sends the conversation
    assert m[("hybridspec:spec_decode_num_draft_tokens_total", (("source", "suffix"),))] > 0
    assert m[("hybridspec:spec_decode_num_accepted_tokens_total", (("source", "suffix"),))] > 0


# SmolLM2-135M cannot plan a fix; it can copy a command it is given. The task names the one command that solves it
# and submits (mini-swe-agent ends when a command's output begins with its submit word).
TOOL_TASK = ("Create hello.txt containing hello and submit, in one command: "
             "`echo hello > hello.txt && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`")


def test_mini_swe_agent_with_its_default_tool_calling_config_solves_a_task(server, tmp_path):
    """mini-swe-agent's default config (mini.yaml: the bash tool, replies read from message.tool_calls), unmodified,
    with examples/mini-swe-agent.yaml pointing it at the server (tool_choice required): the agent calls the tool,
    the command runs, the task is solved and submitted; the call's JSON was drafted by the grammar and the suffix
    cache."""
    before = metrics(server)
    repo, info = run_mini(server, tmp_path, ["mini.yaml", str(ROOT / "examples" / "mini-swe-agent.yaml")],
                          TOOL_TASK, 4)
    assert info["exit_status"] == "Submitted", info
    assert (repo / "hello.txt").read_text() == "hello\n"
    after = metrics(server)
    chat = "/v1/chat/completions"

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    calls = info["model_stats"]["api_calls"]
    assert delta("hybridspec:http_requests_total", endpoint=chat, status="200") == calls >= 1
    assert delta("hybridspec:requests_total", endpoint=chat, finish_reason="tool_calls") == calls
    assert delta("hybridspec:spec_decode_num_accepted_tokens_total", source="grammar") > 0
