"""benchmarks/plot_training.py: acceptance curves and each run's final acceptance against its distinct tokens."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import plot_training  # noqa: E402


def write_log(directory: Path, tokens: int, steps: int, finals: list[float]) -> Path:
    directory.mkdir(parents=True)
    history = [{"step": s, "slots": s * 10, "eval": {"acceptance@7": a}} for s, a in zip((1, steps), finals)]
    (directory / "train_log.json").write_text(json.dumps({
        "train_tokens": tokens, "steps": steps, "final_eval": {"acceptance@7": finals[-1]}, "history": history}))
    return directory


def test_curves_and_data_scaling_points(tmp_path):
    small = write_log(tmp_path / "data-25", 1_000, 8, [1.1, 1.3])
    large = write_log(tmp_path / "data-100", 4_000, 8, [1.2, 1.5])
    out = tmp_path / "training.json"
    assert plot_training.main(["--extra", str(small), "--extra", str(large), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["curves"]["data-25"] == [[10, 1.1], [80, 1.3]]
    assert result["final"]["data-100"] == {"train_tokens": 4_000, "steps": 8, "acceptance": 1.5}
    assert result["final"]["data-25"]["acceptance"] < result["final"]["data-100"]["acceptance"]
    assert out.with_suffix(".png").stat().st_size > 0
