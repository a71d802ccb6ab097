"""benchmarks/bench_soak.py at CI's size (slow: SmolLM2 behind `hybridspec serve`): normal, cancelled, hostile and
oversized requests mixed at one and four workers; every normal reply identical to the same request's alone, no 500,
the server's resident memory back within 10% of its level after warm-up. The pieces: its hostile bodies are refused
by a 4xx on the tiny model too (tests/test_server_hardening.py holds the unit tests)."""
from __future__ import annotations

import json

import httpx
import pytest

import bench_soak
from hybridspec.model.target import TargetModel
from hybridspec.runtime.engine import Engine
from hybridspec.serve import create_app
from test_server import Server


def test_every_hostile_body_of_the_soak_gets_a_4xx(tiny_model, tiny_tokenizer):
    server = Server(create_app(Engine(TargetModel(tiny_model), tiny_tokenizer, verify_cost=None),
                               served_model_name="soak"))
    try:
        for endpoint, raw in bench_soak.hostile_bodies():
            response = httpx.post(server.url + endpoint, content=raw, headers={"Content-Type": "application/json"},
                                  timeout=60)
            assert 400 <= response.status_code < 500, (endpoint, raw[:100], response.text[:300])
    finally:
        server.stop()


@pytest.mark.slow
def test_a_short_soak_serves_every_request_as_it_should(tmp_path):
    out = tmp_path / "soak.json"
    code = bench_soak.main(["--concurrency", "1,4", "--duration-s", "20", "--max-requests", "400", "--warmup-s", "10",
                            "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0, json.dumps({c: v["failures"] for c, v in result["levels"].items()})
    for level in result["levels"].values():
        kinds = level["by_kind"]
        assert min(kinds.get(k, 0) for k in ("normal", "cancelled", "hostile", "oversized")) > 0
        assert level["normal_identical"] == level["normal"] and level["answered_500"] == 0
    assert result["server_500s"] == 0 and result["healthy"] and result["rss_growth"] <= 0.10
    assert result["refused_40mb"]["status"] in (413, None)  # None: the server closed before the client sent it all
    assert result["refused_40mb"]["rss_delta_mib"] < 100
