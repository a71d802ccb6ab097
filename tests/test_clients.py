"""Agent clients as they ship, unmodified, against `hybridspec serve` on SmolLM2 (in a thread on a free port), with
speculation on: OpenAI's Codex CLI through the Responses API, Claude Code through Anthropic's Messages API, the OpenAI
Agents SDK with its default (Responses) model running a function tool. mini-swe-agent: tests/test_server_agent.py.

The CLIs come from npm (scripts/setup_clients.sh puts them under .clients/); each runs one non-interactive turn,
offline, its request trimmed to fit SmolLM2's 8k context (its own instructions replaced, its tools off), in a scratch
HOME. Where a CLI is missing the test says what to run."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from test_server import Server, metrics

pytestmark = pytest.mark.slow
CLIENTS = Path(__file__).resolve().parents[1] / ".clients"
CODEX = CLIENTS / "codex" / "node_modules" / ".bin" / "codex"
CLAUDE = CLIENTS / "claude" / "node_modules" / ".bin" / "claude"


@pytest.fixture(scope="module")
def server():
    from hybridspec.runtime.engine import Engine
    from hybridspec.serve import create_app
    from hybridspec.serve.app import SERVER_DEFAULTS

    # greedy where a request sets no temperature (Claude Code sets none): sampled, SmolLM2 now and then rambles past
    # the CLI's output limit, which it then asks to continue several times before it gives up
    s = Server(create_app(Engine.from_pretrained("smollm2"), served_model_name="smollm2",
                          defaults=SERVER_DEFAULTS.replace(temperature=0)))
    yield s
    s.stop()


def need(binary: Path) -> None:
    if not binary.exists():
        pytest.fail(f"{binary} is missing: run scripts/setup_clients.sh (it needs npm, Node 20+)")


def answered(server: Server, endpoint: str, before: dict) -> float:
    """Requests the server answered at `endpoint` since `before` (its /metrics), whatever their finish."""
    now = metrics(server)
    return sum(v - before.get(k, 0) for k, v in now.items()
               if k[0] == "hybridspec:requests_total" and ("endpoint", endpoint) in k[1])


def test_codex_cli_runs_a_turn_through_the_responses_api(server, tmp_path):
    need(CODEX)
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    instructions = tmp_path / "instructions.md"
    instructions.write_text("You are a helpful assistant. Answer in one short sentence.\n")
    provider = {"name": '"local"', "base_url": f'"{server.url}/v1"', "wire_api": '"responses"',
                "env_key": '"LOCAL_KEY"', "request_max_retries": "0", "stream_max_retries": "0"}
    config = [f"model_providers.local.{k}={v}" for k, v in provider.items()] + [
        "model_provider=local", "model=smollm2", f'model_instructions_file="{instructions}"',
        "include_permissions_instructions=false", "include_environment_context=false",
        "skills.include_instructions=false", 'web_search="disabled"', 'model_reasoning_summary="none"',
        "tools.experimental_request_user_input={enabled=false}", "analytics.enabled=false",
        "check_for_update_on_startup=false"]
    argv = [str(CODEX), "exec", "--skip-git-repo-check", "--ephemeral", "--color", "never",
            *[a for c in config for a in ("-c", c)],
            *[a for f in ("shell_tool", "view_image", "multi_agent", "goals", "plugins") for a in ("--disable", f)],
            "What is the capital of France?"]
    before = metrics(server)
    run = subprocess.run(argv, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
                              "LOCAL_KEY": "unused"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Paris" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]  # the model's (greedy) reply, printed
    assert answered(server, "/v1/responses", before) >= 1


def test_claude_code_runs_a_turn_through_the_messages_api(server, tmp_path):
    need(CLAUDE)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "ANTHROPIC_BASE_URL": server.url,
           "ANTHROPIC_API_KEY": "unused", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "CLAUDE_CODE_ATTRIBUTION_HEADER": "0", "CLAUDE_CODE_DISABLE_THINKING": "1",
           "CLAUDE_CODE_EFFORT_LEVEL": "unset", "DISABLE_PROMPT_CACHING": "1",
           "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "128",
           "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "8192", "CLAUDE_CODE_MAX_RETRIES": "0"}
    (tmp_path / "home").mkdir()
    before = metrics(server)
    run = subprocess.run([str(CLAUDE), "-p", "What is the capital of France?", "--model", "smollm2", "--bare",
                          "--system-prompt", "You are a helpful assistant. Answer in one short sentence.",
                          "--tools", "", "--strict-mcp-config", "--no-session-persistence"],
                         cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "Paris" in run.stdout, run.stdout[-2000:]
    assert answered(server, "/v1/messages", before) >= 1


def test_the_agents_sdk_default_model_runs_a_function_tool(server):
    from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_client,
                        set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0),
                              use_for_tracing=False)
    listed: list[str] = []

    @function_tool
    def list_files(directory: str) -> str:
        """List the files of a directory."""
        listed.append(directory)
        return "setup.py README.md"

    agent = Agent(name="files", instructions="You list files with the list_files tool.", model="smollm2",
                  tools=[list_files], tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=64))
    before = metrics(server)
    result = Runner.run_sync(agent, "Which files are in the src directory?")
    assert len(listed) == 1 and result.final_output == "setup.py README.md"
    assert answered(server, "/v1/responses", before) == 1  # the SDK's default model speaks the Responses API
