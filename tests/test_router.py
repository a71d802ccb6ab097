"""The verify-cost model shared by the router, the engine and trace replay."""
import json

import pytest

from hybridspec.router import DEFAULT_VERIFY_MS, VerifyCost


def test_interpolates_and_extrapolates():
    cost = VerifyCost({0: 59.0, 16: 111.0, 32: 149.0})
    assert cost(0) == 59.0 and cost(16) == 111.0
    assert cost(24) == pytest.approx((111.0 + 149.0) / 2)
    assert cost(40) == pytest.approx(149.0 + 8 * (149.0 - 111.0) / 16)
    assert cost.relative(16) == pytest.approx(111.0 / 59.0)
    assert VerifyCost().table() == DEFAULT_VERIFY_MS


def test_loads_tables_and_measurements(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"0": 10, "8": 12}))
    assert VerifyCost.load(tmp_path / "t.json")(4) == pytest.approx(11.0)
    measured = {"verify_cost": {"draft_tokens": [0, 2, 4], "ms": [20.0, 30.0, 32.0], "relative": [1, 1.5, 1.6]}}
    (tmp_path / "m.json").write_text(json.dumps(measured))
    assert VerifyCost.load(tmp_path / "m.json")(3) == pytest.approx(31.0)
    assert VerifyCost.load({0: 1.0, 2: 3.0})(1) == pytest.approx(2.0)
    assert VerifyCost.load(None).table() == DEFAULT_VERIFY_MS


def test_bad_tables_are_rejected(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"4": 10}))
    with pytest.raises(ValueError, match="bad.json.*k = 0"):
        VerifyCost.load(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        VerifyCost.load(tmp_path / "junk.json")
    with pytest.raises(ValueError, match="> 0"):
        VerifyCost({0: 10.0, 4: -1.0})
