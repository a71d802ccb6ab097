"""benchmarks/bench_architectures.py on tiny shapes: both methods decode the same tokens (the script checks), the
table's ratios come from its own timings, the expert bytes a decode token multiplies are top_k of the experts, and
llama.cpp decodes transformers' tokens from the GGUF written for each architecture; benchmarks/bench_moe_block.py
on tiny MoE layers."""
from __future__ import annotations

import json

import pytest
import torch

import bench_architectures
from common import PEERS_PYTHON, VLLM_PYTHON
from hybridspec.model.linear import AMX, KERNEL_ROWS

TINY = {
    "tiny-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
        norm_topk_prob=True, tie_word_embeddings=False)),
    "tiny-oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4, sliding_window=8,
        tie_word_embeddings=False, attn_implementation="eager")),
}


def test_tiny_run_times_both_and_counts_the_chosen_experts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_architectures, "SHAPES", TINY)
    out = tmp_path / "arch.json"
    assert bench_architectures.main(["--models", "tiny-moe,tiny-oss", "--prompt", "24", "--new", "12", "--repeats",
                                     "1", "--threads", "1", "--peers", "", "--json", str(out)]) == 0
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    for name, top_k in (("tiny-moe", 2), ("tiny-oss", 4)):
        row = rows[name]
        assert row["decode_speedup"] == pytest.approx(
            row["transformers_decode_ms_per_token"] / row["hybridspec_decode_ms_per_token"])
        assert row["hybridspec_prefill_ms_per_token"] > 0 and row["transformers_decode_ms_per_token"] > 0
        assert row["expert_mib_per_token"] == pytest.approx(row["expert_mib_all"] * top_k / 8)
        # the memory bound: every float32 weight once but the untied embedding, of the experts the chosen ones
        shape = TINY[name][2]
        model = bench_architectures.build(name)
        params = sum(p.numel() for p in model.parameters()) - shape["vocab_size"] * shape["hidden_size"]
        experts = {n: p.numel() for n, p in model.named_parameters() if ".experts." in n}
        assert row["weight_mib_per_token"] == pytest.approx(4 * (params - sum(experts.values()) * (1 - top_k / 8))
                                                            / 2 ** 20)
        # the experts' weights as the engine reads them: bfloat16 values in bfloat16 where the kernel runs
        weights = sum(n for name_, n in experts.items() if not name_.endswith("_bias"))
        assert row["expert_mib_all"] == pytest.approx((2 if KERNEL_ROWS else 4) * weights / 2 ** 20)
        assert row["decode_bound_ms"] == pytest.approx(row["weight_mib_per_token"] * 2 ** 20 / row["stream_gb_s"] / 1e6)
    assert "| tiny-moe |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_architectures.main(["--models", "nope"])


@pytest.mark.slow
@pytest.mark.vllm
def test_the_peers_time_the_same_weights(tmp_path, monkeypatch, capsys):
    """vLLM on CPU (.venv-vllm) and llama.cpp (.venv-peers, a GGUF written from the weights) run a tiny Qwen3 (peaked
    logits): both decode the tokens of the others, so each ran the same model, and the ratios come from their own
    timings; an architecture a peer does not run is reported, not fatal."""
    shapes = {
        "tiny-qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(  # vLLM's CPU attention wants head_dim >= 32
            vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, tie_word_embeddings=False, initializer_range=0.3)),
        "tiny-qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False)),
    }
    monkeypatch.setattr(bench_architectures, "SHAPES", shapes)
    out = tmp_path / "arch.json"  # three rounds: a tiny model's decode time is a difference of two calls' noise
    assert bench_architectures.main(["--models", "tiny-qwen3,tiny-qwen3.5", "--prompt", "24", "--new", "12",
                                     "--repeats", "3", "--json", str(out)]) == 0
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    printed = capsys.readouterr().out
    for peer in ("vllm", "llama.cpp"):
        got = rows["tiny-qwen3"]["peers"][peer]
        assert "error" not in got and got["same_tokens"], got
        for part in ("prefill", "decode"):
            if peer == "vllm":  # the engine in vLLM's process, in turns with it: the median of the rounds' ratios
                assert got["in_turns"] and got[f"{part}_ratio"] > 0 and got[f"hybridspec_{part}_ms_per_token"] > 0
                continue
            # to the mean of the engine's timings on either side of the peer
            assert got[f"{part}_ratio"] == pytest.approx(
                got[f"{part}_ms_per_token"] / got[f"hybridspec_{part}_ms_per_token"])
        hybrid = rows["tiny-qwen3.5"]["peers"][peer]  # a peer that does not run Qwen3.5 says so, not fatal
        assert hybrid.get("same_tokens") is not None if "error" not in hybrid else \
            f"tiny-qwen3.5: {peer} did not run" in printed


@pytest.mark.slow
@pytest.mark.skipif(not PEERS_PYTHON.exists(), reason=f"{PEERS_PYTHON} is missing (scripts/setup_peers.sh makes it)")
def test_llama_cpp_decodes_the_gguf_written_for_gpt_oss_and_qwen3_5():
    """write_gguf on a tiny gpt-oss (sinks, every other layer windowed, biased router and experts, YaRN) and a tiny
    Qwen3.5 (Gated DeltaNet with 2 key heads to 4 value heads, gated attention, partial RoPE) and Qwen3.5-MoE, logits
    peaked and norms, biases, sinks and DeltaNet decays random: llama.cpp greedy-decodes transformers' tokens."""
    import transformers

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, initializer_range=0.3, tie_word_embeddings=False)
    # llama.cpp rounds YaRN's correction range (truncate), and its Qwen3.5 wants key and value heads of one size
    yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": True, "original_max_position_embeddings": 128}
    hybrid = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  layer_types=["linear_attention", "full_attention"] * 2)
    torch.manual_seed(0)  # the same tiny models every run
    models = {
        "gpt-oss": transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **common, num_local_experts=8, num_experts_per_tok=2, sliding_window=8, rope_parameters=yarn,
            attn_implementation="eager")),
        "qwen3.5": transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**common, **hybrid)),
        "qwen3.5-moe": transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(
            **common, **hybrid, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32)),
    }
    prompt = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    for name, model in models.items():
        torch.manual_seed(0)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param.ndim == 1 or param_name.endswith("bias"):
                    param.add_(0.3 * torch.randn_like(param))
            expected = model.eval().generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                                             do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        got = bench_architectures.llama_cpp_timings(model, {"prompt": prompt, "new": 1, "repeats": 1, "threads": 1})
        assert got.get("tokens") == expected, (name, got)


def tiny_moe_blocks(intermediate: int) -> dict:
    """bench_moe_block's SHAPES for a tiny Qwen3-MoE and gpt-oss layer with experts of `intermediate` hidden units."""
    import transformers

    return {
        "tiny-moe": ("Qwen3MoeForCausalLM", lambda: transformers.Qwen3MoeConfig(
            vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=intermediate)),
        "tiny-oss": ("GptOssForCausalLM", lambda: transformers.GptOssConfig(
            vocab_size=64, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4))}


@pytest.mark.skipif(not KERNEL_ROWS, reason="the product kernels need an AVX-512 CPU")
def test_bench_moe_block_times_the_three_ways_on_tiny_shapes(tmp_path, monkeypatch, capsys):
    """benchmarks/bench_moe_block.py on tiny MoE layers: every way's output is checked against the expert-by-expert
    one (a wrong kernel fails the run), the ratio is of its own timings, and the panel kernel ran."""

    import bench_moe_block
    from hybridspec.model import layers

    monkeypatch.setattr(bench_moe_block, "SHAPES", tiny_moe_blocks(intermediate=40))
    grouped, real = [], layers.grouped_expert_products
    monkeypatch.setattr(layers, "grouped_expert_products", lambda *a, **k: grouped.append(1) or real(*a, **k))
    out = tmp_path / "moe.json"
    assert bench_moe_block.main(["--models", "tiny-moe,tiny-oss", "--tokens", "48", "--repeats", "1",
                                 "--threads", "1", "--no-vllm", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert grouped and [r["model"] for r in rows] == ["tiny-moe", "tiny-oss"]
    for row in rows:
        assert row["panel_speedup_vs_onednn"] == pytest.approx(
            row["ms"]["oneDNN expert by expert"] / row["ms"]["panel kernel"])
    assert "| tiny-oss |" in capsys.readouterr().out
    assert all("AMX tiles" not in r["ms"] for r in rows)  # experts of 40 units: no multiple of 32
    # experts of 64 units: the AMX tiles' way too, where this CPU has them
    monkeypatch.setattr(bench_moe_block, "SHAPES", tiny_moe_blocks(intermediate=64))
    assert bench_moe_block.main(["--models", "tiny-moe", "--tokens", "48", "--repeats", "1", "--threads", "1",
                                 "--no-vllm", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert ("AMX tiles" in row["ms"]) == AMX
    if AMX:
        assert row["amx_speedup_vs_panel"] == pytest.approx(row["ms"]["panel kernel"] / row["ms"]["AMX tiles"])
        assert "AMX vs panel" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_moe_block.main(["--models", "nope"])


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not KERNEL_ROWS, reason="the product kernels need an AVX-512 CPU")
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"{VLLM_PYTHON} is missing (scripts/setup_vllm.sh makes it)")
def test_bench_moe_block_times_vllms_fused_moe_on_the_same_layer(tmp_path, monkeypatch, capsys):
    """bench_moe_block.py's vLLM column: vLLM's fused-MoE kernel (in .venv-vllm) and the panel kernel on a tiny
    layer's experts and routing compute the same outputs (SiLU, and gpt-oss's clamped SwiGLU with biases), and the
    ratio printed is of the worker's own timings."""

    import bench_moe_block

    # vLLM's kernel wants sizes in 32s (gate_up's in 64s)
    monkeypatch.setattr(bench_moe_block, "SHAPES", tiny_moe_blocks(intermediate=64))
    out = tmp_path / "moe.json"
    assert bench_moe_block.main(["--models", "tiny-moe,tiny-oss", "--tokens", "80", "--repeats", "1",
                                 "--threads", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for row in json.loads(out.read_text())["rows"]:
        got = row["vllm"]
        assert "error" not in got, got
        assert got["max_abs_diff"] < 1e-4
        ratio = got["ms"]["vLLM fused MoE"] / got["ms"]["panel kernel"]
        assert f"| {row['model']} | " in printed and f"**{ratio:.2f}x**" in printed


def test_profile_prefill_parts_add_up_to_the_prefill(tmp_path, monkeypatch, capsys):
    """benchmarks/profile_prefill.py: each part is charged its own time (nested timers do not count a callee twice),
    so the parts and the remainder are the prefill; the MoE's parts appear on a MoE; the methods are restored."""
    import profile_prefill
    from hybridspec.model.target import TargetModel

    monkeypatch.setattr(bench_architectures, "SHAPES", TINY)
    attend = TargetModel._attend
    out = tmp_path / "parts.json"
    assert profile_prefill.main(["--models", "tiny-moe", "--prompt", "40", "--repeats", "2", "--threads", "1",
                                 "--json", str(out)]) == 0
    got = json.loads(out.read_text())["models"]["tiny-moe"]
    assert got["remainder_ms"] >= 0 and sum(got["parts"].values()) + got["remainder_ms"] == pytest.approx(got["ms"])
    assert {"attention (cache writes and kernel)", "MoE routing", "products (qkv, router, head)"} <= set(got["parts"])
    assert TargetModel._attend is attend
    assert "| MoE routing |" in capsys.readouterr().out
    # --decode: greedy steps after the prompt, their parts adding up to a step
    assert profile_prefill.main(["--models", "tiny-moe", "--prompt", "40", "--repeats", "2", "--threads", "1",
                                 "--decode", "3", "--json", str(out)]) == 0
    got = json.loads(out.read_text())["models"]["tiny-moe"]
    assert got["ms_per_token"] == got["ms"] and sum(got["parts"].values()) + got["remainder_ms"] == \
        pytest.approx(got["ms"])
    assert "MoE routing" in got["parts"] and "a decode step after 40 tokens" in capsys.readouterr().out
