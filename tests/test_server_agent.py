"""An unmodified agent framework on `hybridspec serve`: mini-swe-agent 2.4.6's `mini` command (through litellm's
OpenAI-compatible route) with the README's config, examples/mini-swe-agent.yaml, against the server on the real
SmolLM2, in a throwaway git repository with a step limit. SmolLM2-135M rarely follows the agent's format, so this
checks the calls, not the outcome: every one of the agent's calls succeeded through the server (the server counted
exactly that many, none answered 4xx/5xx), and the agent's re-sent conversation hit the prefix cache and was drafted
by the suffix cache (/metrics)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`hybridspec serve` (SmolLM2, suffix speculation) as a subprocess on a free port."""
    port, log_path = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(BIN / "hybridspec"), "serve", "--port", str(port)], stdout=log,
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
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def metrics(url: str) -> dict[tuple, float]:
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_mini_swe_agent_runs_on_the_server(server, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "greet.py").write_text('def greet(name):\n    return "Hello " + name\n')
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run(git + args, cwd=repo, check=True)
    env = {**os.environ, "MSWEA_CONFIGURED": "true", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "config")}
    trajectory = tmp_path / "run.traj.json"
    run = subprocess.run(
        [str(BIN / "mini"), "-c", "mini_textbased.yaml", "-c", str(ROOT / "examples" / "mini-swe-agent-textbased.yaml"),
         "-c", f"model.model_kwargs.api_base={server}/v1", "-c", "agent.step_limit=3",
         "-y", "--exit-immediately", "-t", TASK, "-o", str(trajectory)],
        cwd=repo, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    info = json.loads(trajectory.read_text())["info"]
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
