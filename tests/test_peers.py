"""The ArcticInference adapter (hybridspec.tools.peers.ArcticSuffixProposer).

arctic-inference lives in its own environment (.venv-peers, made by scripts/setup_peers.sh), so the adapter's checks run
in a subprocess of that environment's Python; they are skipped, with the reason, where that environment was not set up.
"""
from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridspec.tools.peers import ArcticSuffixProposer

from common import PEERS_PYTHON

ROOT = Path(__file__).resolve().parents[1]


def test_missing_peer_gives_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "arctic_inference", None)  # makes `import arctic_inference...` fail here
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(ImportError, match="scripts/setup_peers.sh"):
        ArcticSuffixProposer()


def peer_checks() -> None:
    """Runs under .venv-peers/bin/python (no pytest there): the adapter against the peer driven directly as vLLM
    drives it, plus the life-cycle rules of our Proposer protocol. Raises AssertionError on any difference."""
    import numpy as np
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    from hybridspec.tools.peers import ArcticSuffixProposer

    def expect(exc, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except exc:
            return
        raise AssertionError(f"{fn.__name__}{args} did not raise {exc.__name__}")

    rng = np.random.default_rng(0)
    for depth, tree in ((64, False), (8, True)):
        settings = dict(max_spec_factor=1.0, max_spec_offset=1.0, min_token_prob=0.1)
        adapter = ArcticSuffixProposer(max_depth=depth, num_speculative_tokens=6, **settings)
        raw = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=10_000)
        held = 0
        for r in range(5):  # later requests draw on earlier responses through the global tree
            prompt = rng.integers(0, 5, int(rng.integers(1, 60))).astype(np.int32)
            context = list(prompt)
            adapter.start_request(r, prompt.tolist())
            raw.start_request(r, prompt)
            for _ in range(25):
                got = adapter.speculate(r, tree=tree)
                ctx = np.asarray(context[-depth:], dtype=np.int32)
                want = raw.speculate(r, ctx, max_spec_tokens=6, use_tree_spec=tree, **settings)
                assert (got.token_ids, got.parents, got.probs, got.score) == \
                    (want.token_ids, want.parents, want.probs, want.score), (r, got, want)
                assert got.source == "arctic-suffix" and got.match_len == (want.match_len if want.token_ids else 0)
                step = rng.integers(0, 5, int(rng.integers(1, 4))).astype(np.int32)
                adapter.append(r, step)
                raw.add_active_response(r, step)
                context += step.tolist()
                held += len(step)
            adapter.finish_request(r)
            raw.stop_request(r)
        assert adapter.indexed_tokens() == held  # only responses remain, in the global tree
        assert adapter.memory_bytes() > 0

    # num_speculative_tokens: None takes the default, 0 gives nothing (the peer itself reads 0 as "max depth")
    p = ArcticSuffixProposer(max_depth=16, num_speculative_tokens=3)
    p.start_request("a", list(range(10)) + list(range(8)))
    assert p.speculate("a").token_ids == [8, 9, 0]  # what followed the earlier occurrence of 0..7
    assert p.speculate("a", num_speculative_tokens=None) == p.speculate("a")
    assert p.speculate("a", num_speculative_tokens=2).token_ids == [8, 9]
    assert p.speculate("a", num_speculative_tokens=0).token_ids == []
    expect(ValueError, p.speculate, "a", num_speculative_tokens=-1)
    expect(TypeError, p.speculate, "a", num_speculative_tokens=1.5)
    expect(ValueError, p.start_request, "a", [1])
    expect(KeyError, p.append, "nope", [1])
    expect(KeyError, p.speculate, "nope")
    expect(KeyError, p.finish_request, "nope")
    expect(ValueError, p.append, "a", [-1])
    expect(TypeError, p.append, "a", [0.5])

    # a finished response serves later requests; an aborted one does not
    p = ArcticSuffixProposer(max_depth=32, num_speculative_tokens=8)
    response = list(range(100, 120))
    p.start_request("done", [1, 2, 3])
    p.append("done", response)
    p.finish_request("done")
    p.start_request("aborted", [4, 5, 6])
    p.append("aborted", list(range(200, 220)))
    p.abort_request("aborted")
    p.start_request("next", [7, 100, 101, 102, 103], extends="done")  # no session API: the prompt is indexed afresh
    assert p.speculate("next").token_ids == list(range(104, 108))
    p.append("next", [200, 201, 202, 203])
    assert p.speculate("next").token_ids == []
    # the peer evicts the oldest responses beyond max_cached_requests; indexed_tokens follows
    p = ArcticSuffixProposer(max_depth=8, max_cached_requests=2)
    for r, n in enumerate((5, 6, 7, 8)):
        p.start_request(r, [1, 2])
        p.append(r, list(range(10, 10 + n)))
        p.finish_request(r)
    assert p.indexed_tokens() == 7 + 8
    print("peer checks passed")


@pytest.mark.peers
def test_arctic_adapter_matches_the_peer_driven_directly():
    if not PEERS_PYTHON.exists():
        pytest.skip(f"{PEERS_PYTHON} not found: run scripts/setup_peers.sh to set up the peer environment")
    code = textwrap.dedent(inspect.getsource(peer_checks)) + "\npeer_checks()\n"
    proc = subprocess.run([str(PEERS_PYTHON), "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"peer checks failed:\n{proc.stdout}\n{proc.stderr}"
    assert "peer checks passed" in proc.stdout
