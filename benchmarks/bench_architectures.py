"""Prefill and decode per token of the architectures the engine runs, against transformers, on random weights of
realistic shapes (no download).

Shapes (float32; the random weights rounded to bfloat16 values, as the published checkpoints ship them and every
method here loads them into float32: the engine streams such a weight in bfloat16 for a step's products, the same bits
from half the bytes; `--values float32` keeps any float32 values, the timing of a float32 checkpoint): Qwen3-0.6B as
published (28 layers, hidden 1024, 16/8 heads of 128, vocabulary 151,936); a Qwen3-MoE and a gpt-oss cut to fit
this machine (their published layer shapes: 64 experts of 384 with 8 a token, hidden 1024; gpt-oss: 32 experts of
1024, 4 a token, sinks, every other layer windowed to 128, vocabulary 201,088; fewer layers); a Qwen3.5 hybrid at
hidden 1024 (24 layers, three Gated DeltaNet layers of 16 heads of 128 to one gated attention layer of 8/2 heads of
256, partial RoPE, vocabulary 248,320). Per model, methods taking turns: a
prompt of `--prompt` random tokens to its first token (prefill, ms per prompt token), and `--new` more tokens by
plain greedy decoding (decode, ms per token: the difference of the two calls over the tokens between). hybridspec:
`Engine.generate(speculate="none")`, prefix cache off; transformers: `generate` (SDPA; gpt-oss: eager, its only CPU
attention; Qwen3.5: its PyTorch gated delta rule, what runs without the CUDA-only kernels). `--peers`, each in a
process of its own after the others, on the same weights (the architectures one does not run say why): vLLM on CPU
(.venv-vllm; `LLM.generate` on the weights saved to a directory, float32, prefix caching off), with the engine loaded
in that process from the same directory and the two timed in turns (their ratio the median of the rounds'), and
llama.cpp (llama-cpp-python in .venv-peers; the weights written to a float32 GGUF, for Qwen3, Qwen3-MoE, gpt-oss and
Qwen3.5 dense and MoE; greedy by argmax over its logits), timed as the engine is: a prompt to its first token, then
per decoded token, the engine timed again after it and its ratio to the mean of the engine's timings on either side
(this host's memory bandwidth drifts between minutes). MoE rows: the expert weights a decode token multiplied
(counted on the engine's products) against all of a layer's experts.

    .venv/bin/python benchmarks/bench_architectures.py --json out/bench_architectures.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridspec.model.machine import release_free_memory

from common import PEERS_PYTHON, VLLM_ENV, VLLM_PYTHON, machine_info, median_ms_each, streaming_gb_s, write_json

VLLM_WORKER = Path(__file__).with_name("vllm_decode_worker.py")
LLAMA_CPP_WORKER = Path(__file__).with_name("llama_cpp_decode_worker.py")

SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    "qwen3-moe-8l": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
        head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384, intermediate_size=3072,
        norm_topk_prob=True, tie_word_embeddings=False)),
    "gpt-oss-4l": ("GptOssConfig", "GptOssForCausalLM", dict(
        vocab_size=201088, hidden_size=1024, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        tie_word_embeddings=False, attn_implementation="eager",
        # YaRN's correction range rounded to whole dimensions, as llama.cpp always does (the release says not), so
        # that every method decodes the same tokens; the timing is the same either way
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0})),
    "qwen3.5-hybrid-24l": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True)),
}


def build(name: str, values: str = "bfloat16"):
    """The shape's model in float32, random weights whose values are bfloat16 ones (a published bfloat16 checkpoint
    loaded into float32, as every method here loads it) or any float32 ones (`values="float32"`)."""
    import transformers

    config_cls, model_cls, shape = SHAPES[name]
    config = getattr(transformers, config_cls)(**{"attn_implementation": "sdpa", "initializer_range": 0.02,
                                                  "max_position_embeddings": 4096, "eos_token_id": 0,
                                                  "pad_token_id": 0, **shape})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    if values == "bfloat16":
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(torch.bfloat16))
    return model


def expert_bytes(engine, prompt: list[int]) -> tuple[float, float]:
    """MiB of expert weights one decode token multiplied, counted on the engine's products (the small-row kernel's
    calls for the chosen experts, or each expert's own products), and MiB of all experts of those layers."""
    from hybridspec.model import layers as model_layers

    layers = [layer.mlp for layer in engine.target.layers if hasattr(layer.mlp, "experts")]
    counted = {"bytes": 0}

    def counting(product, size: int):
        def call(x):
            counted["bytes"] += size
            return product(x)
        return call

    def chosen(x, weights, chosen, stacked, *rest):
        gate_up, _, down, _ = stacked
        counted["bytes"] += gate_up.element_size() * len(chosen.unique()) * (gate_up[0].numel() + down[0].numel())
        return kernel(x, weights, chosen, stacked, *rest)

    saved, kernel = [moe.experts for moe in layers], model_layers.step_expert_sums
    try:
        model_layers.step_expert_sums = chosen
        for moe in layers:
            moe.experts = [(counting(g, 4 * (g.shape[0] * g.shape[1] + d.shape[0] * d.shape[1])), d)
                           for g, d in moe.experts]
        engine.generate(prompt, max_new_tokens=2, speculate="none")  # the prompt, then one decode step
        first = counted["bytes"]
        engine.generate(prompt, max_new_tokens=3, speculate="none")  # the same, and one more step
        one_token = counted["bytes"] - 2 * first
    finally:
        model_layers.step_expert_sums = kernel
        for moe, experts in zip(layers, saved):
            moe.experts = experts
    # all experts in the format the engine reads them in
    total = sum((moe.stacked[0].element_size() if moe.kernel else 4) * (moe.stacked[0].numel() + moe.stacked[2].numel())
                for moe in layers)
    return one_token / 2 ** 20, total / 2 ** 20


def decode_weight_mib(model, row: dict) -> float:
    """MiB of float32 weights one decode token multiplies: every parameter but an untied embedding (one row of it is
    read) and, of a mixture of experts, only the chosen experts (the share `expert_bytes` counted)."""
    params = sum(p.numel() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        params -= model.get_input_embeddings().weight.numel()
    if "expert_mib_all" in row:
        experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        params -= experts * (1 - row["expert_mib_per_token"] / row["expert_mib_all"])
    return 4 * params / 2 ** 20


def peer_timings(python: Path, worker: Path, job: dict, env: dict) -> dict:
    """A peer's worker (vllm_decode_worker.py, llama_cpp_decode_worker.py) in a process of its own: ms per prompt
    token and per decoded token and its first tokens, or why it did not run."""
    if not python.exists():
        return {"error": f"{python} is missing (scripts/setup_vllm.sh, scripts/setup_peers.sh make them)"}
    try:
        done = subprocess.run([str(python), str(worker), json.dumps(job)], env={**os.environ, **env}, text=True,
                              capture_output=True, timeout=3600)
    except subprocess.TimeoutExpired:
        return {"error": "it ran past an hour"}
    for line in done.stdout.splitlines():
        kind, _, payload = line.partition(" ")
        if kind == "@@result":
            got = json.loads(payload)
            timings = {"prefill_ms_per_token": got["prefill_ms"] / len(job["prompt"]),
                       "decode_ms_per_token": got["decode_ms"], "tokens": got["tokens"]}
            if "prefill_ratio" in got:  # the engine timed in turns with the peer, in its process
                timings.update(hybridspec_prefill_ms_per_token=got["hybridspec_prefill_ms"] / len(job["prompt"]),
                               hybridspec_decode_ms_per_token=got["hybridspec_decode_ms"], in_turns=True,
                               prefill_ratio=got["prefill_ratio"], decode_ratio=got["decode_ratio"])
            return timings
        if kind == "@@error":
            return {"error": json.loads(payload)["error"]}
    lines = done.stderr.strip().splitlines() or [""]
    reason = next((line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1])
    return {"error": f"the worker exited {done.returncode}: {reason.strip()[:300]}"}


def vllm_timings(model, job: dict) -> dict:
    """vLLM on this CPU (.venv-vllm) on the same weights, saved to a temporary directory, float32."""
    with tempfile.TemporaryDirectory(prefix="bench-arch-") as tmp:
        model.save_pretrained(tmp)
        env = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(job["threads"])}
        return peer_timings(VLLM_PYTHON, VLLM_WORKER, {**job, "model": tmp, "dtype": "float32"}, env)


def llama_cpp_timings(model, job: dict) -> dict:
    """llama.cpp (llama-cpp-python in .venv-peers) on the same weights written to a float32 GGUF."""
    with tempfile.TemporaryDirectory(prefix="bench-arch-") as tmp:
        path = Path(tmp) / "model.gguf"
        try:
            write_gguf(model, path)
        except KeyError as e:
            return {"error": f"no GGUF writer here for {e}"}
        return peer_timings(PEERS_PYTHON, LLAMA_CPP_WORKER, {**job, "gguf": str(path)}, {})


PEERS = {"vllm": vllm_timings, "llama.cpp": llama_cpp_timings}


def write_gguf(model, path: Path) -> None:
    """The model's float32 weights as llama.cpp reads them, with a placeholder vocabulary (the benchmark passes token
    ids): Qwen3, Qwen3-MoE, gpt-oss (its experts in float32, not MXFP4), and Qwen3.5 and Qwen3.5-MoE text models. Any
    other `model_type` raises KeyError. llama.cpp's limits: it always rounds YaRN's correction range to whole
    dimensions (transformers' `truncate: True`; gpt-oss as published says False, so its rotary frequencies differ a
    little there), and its Qwen3.5 wants DeltaNet key and value heads of one size (else it does not load)."""
    import gguf

    config = model.config
    arch = {"qwen3": gguf.MODEL_ARCH.QWEN3, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "gpt_oss": gguf.MODEL_ARCH.GPT_OSS,
            "qwen3_5_text": gguf.MODEL_ARCH.QWEN35, "qwen3_5_moe_text": gguf.MODEL_ARCH.QWEN35MOE}[config.model_type]
    hybrid = arch in (gguf.MODEL_ARCH.QWEN35, gguf.MODEL_ARCH.QWEN35MOE)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "yarn":  # without attention_factor both derive it from the factor alike
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope.get("beta_fast", 32.0))
        writer.add_rope_scaling_yarn_beta_slow(rope.get("beta_slow", 1.0))
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(getattr(config, "moe_intermediate_size", config.intermediate_size))
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == gguf.MODEL_ARCH.GPT_OSS:  # llama.cpp windows every other layer from layer 0 itself, as gpt-oss does
        writer.add_sliding_window(config.sliding_window)
    if hybrid:
        writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
        writer.add_ssm_state_size(config.linear_key_head_dim)
        writer.add_ssm_group_count(config.linear_num_key_heads)
        writer.add_ssm_time_step_rank(config.linear_num_value_heads)
        writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
        linear = [kind == "linear_attention" for kind in config.layer_types]
        writer.add_array(f"{writer.arch}.attention.recurrent_layers", linear)  # this gguf-py has no add_ for it
        writer.add_full_attention_interval(linear.index(False) + 1)
        rotary = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(rotary)
        # llama.cpp requires multimodal RoPE sections, summing to at most the head size; a text position is the same
        # in all three, so any split of the rotated pairs is the text model's RoPE
        pairs = rotary // 2
        writer.add_rope_dimension_sections([pairs - 2 * (pairs // 3), pairs // 3, pairs // 3, 0])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(["t", "0", "t0"] + [f"t{i}" for i in range(3, config.vocab_size)])
    writer.add_token_types([gguf.TokenType.NORMAL] * config.vocab_size)
    writer.add_token_merges(["t 0"])  # a merge list both readers accept; none is ever used (ids go in)
    writer.add_eos_token_id(0)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().float()
        if hybrid:
            name, tensor = qwen3_5_tensor(config, name, tensor)
        if arch == gguf.MODEL_ARCH.GPT_OSS and ".experts." in name:
            tensors = gpt_oss_expert_tensors(names, name, tensor)
        elif name.endswith("experts.gate_up_proj"):  # [experts, 2 x intermediate, hidden]: gate rows, then up rows
            gate, up = tensor.chunk(2, dim=1)
            block = names.get_name(name.replace("gate_up_proj", "gate_proj"))
            tensors = [(block + ".weight", gate), (block.replace("gate", "up") + ".weight", up)]
        elif name.endswith("experts.down_proj"):
            tensors = [(names.get_name(name) + ".weight", tensor)]
        elif name.endswith(".sinks"):  # llama.cpp looks for attn_sinks.weight
            tensors = [(names.get_name(name) + ".weight", tensor)]
        else:
            tensors = [(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor)]
        for gguf_name, t in tensors:
            if gguf_name is None:
                raise ValueError(f"no GGUF name for {name}")
            writer.add_tensor(gguf_name, t.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gpt_oss_expert_tensors(names, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One of gpt-oss's expert tensors as llama.cpp's: transformers stores them [experts, in, out] with gate and up
    interleaved (gate, up, gate, ...) along gate_up_proj's out; llama.cpp wants [experts, out, in], each apart."""
    block = names.get_name(name.replace("gate_up_proj", "gate_proj").removesuffix("_bias"))
    if name.endswith("gate_up_proj"):
        tensor = tensor.transpose(1, 2)
    if name.endswith("gate_up_proj") or name.endswith("gate_up_proj_bias"):
        suffix = ".bias" if name.endswith("_bias") else ".weight"
        return [(block + suffix, tensor[:, 0::2]), (block.replace("gate", "up") + suffix, tensor[:, 1::2])]
    if name.endswith("down_proj"):
        return [(block + ".weight", tensor.transpose(1, 2))]
    if name.endswith("down_proj_bias"):
        return [(block + ".bias", tensor)]
    raise ValueError(f"unexpected gpt-oss expert tensor {name}")


def qwen3_5_tensor(config, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One Qwen3.5 weight as llama.cpp's QWEN35/QWEN35MOE reads it: -exp(A_log), dt_bias as dt_proj.bias, the conv
    kernel without its channel axis, (1 + weight) norms stored as such (not the gated norm, which multiplies by weight),
    and the DeltaNet value heads tiled over the key heads rather than grouped by them."""
    k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
    if ".linear_attn." in name and v_heads != k_heads:
        def tiled(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:  # (k, v per k, size) -> (v per k, k, size)
            return t.unflatten(dim, (k_heads, v_heads // k_heads, size)).transpose(dim, dim + 1).flatten(dim, dim + 2)

        v_dim, qk = config.linear_value_head_dim, 2 * k_heads * config.linear_key_head_dim
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # q and k channels, then v's
            tensor = torch.cat([tensor[:qk], tiled(tensor[qk:], 0, v_dim)])
        elif name.endswith("in_proj_z.weight"):
            tensor = tiled(tensor, 0, v_dim)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            tensor = tiled(tensor, 0, 1)
        elif name.endswith("out_proj.weight"):
            tensor = tiled(tensor, 1, v_dim)
    if name.endswith(".A_log"):
        tensor = -tensor.exp()
    elif name.endswith(".dt_bias"):
        name = name.removesuffix("dt_bias") + "dt_proj.bias"
    elif name.endswith("conv1d.weight"):
        tensor = tensor.squeeze(1)
    elif name.endswith("norm.weight") and ".linear_attn." not in name:
        tensor = tensor + 1
    return name, tensor


def new_engine(model):
    from hybridspec.model.target import TargetModel
    from hybridspec.runtime.engine import Engine
    from hybridspec.tools.testing import tiny_tokenizer

    return Engine(TargetModel(model), tiny_tokenizer(128), prefix_cache_bytes=0,
                  verify_cost=None)  # plain decoding: no verification costs to measure


def ours(engine, prompt: list[int], n: int):
    return lambda: engine.generate(prompt, max_new_tokens=n, speculate="none", ignore_eos=True)


def engine_timings(model, prompt: list[int], new: int, repeats: int) -> tuple[float, float]:
    """The engine's prefill and decode ms per token on a fresh engine of the model, timed as in the main run."""
    engine = new_engine(model)
    with torch.inference_mode():
        ms = median_ms_each({1: ours(engine, prompt, 1), new + 1: ours(engine, prompt, new + 1)}, repeats, warmup=1)
    return ms[1] / len(prompt), (ms[new + 1] - ms[1]) / new


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new", type=int, default=32, help="decoded tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated, of {', '.join(PEERS)} (empty: transformers only)")
    parser.add_argument("--values", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the random weights' values: bfloat16 ones in float32 (a published bfloat16 checkpoint "
                             "loaded into float32, what every method here computes in) or any float32 ones")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    peers = [p for p in args.peers.split(",") if p]
    if unknown := set(peers) - set(PEERS):
        parser.error(f"unknown peers {sorted(unknown)}; choose from {', '.join(PEERS)}")
    if unknown := set(models) - set(SHAPES):
        parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(SHAPES)}")
    if args.prompt < 1 or args.new < 2 or args.repeats < 1:
        parser.error("--prompt must be positive, --new at least 2, --repeats positive")
    torch.set_num_threads(args.threads)

    rows = []
    for name in models:
        t0 = time.perf_counter()
        model = build(name, args.values)
        engine = new_engine(model)
        print(f"{name}: built in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        prompt = torch.randint(3, 128, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
        ids = torch.tensor([prompt])

        def theirs(n: int):
            return lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

        with torch.inference_mode():
            reference = theirs(8)()[0, args.prompt:].tolist()  # every method decodes these tokens
            assert ours(engine, prompt, 8)().token_ids == reference, f"{name}: outputs differ"
            ms = median_ms_each({("hybridspec", 1): ours(engine, prompt, 1), ("transformers", 1): theirs(1),
                                 ("hybridspec", args.new + 1): ours(engine, prompt, args.new + 1),
                                 ("transformers", args.new + 1): theirs(args.new + 1)}, args.repeats, warmup=1)
        row = {"model": name, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
        for method in ("hybridspec", "transformers"):
            row[f"{method}_prefill_ms_per_token"] = ms[(method, 1)] / args.prompt
            row[f"{method}_decode_ms_per_token"] = (ms[(method, args.new + 1)] - ms[(method, 1)]) / args.new
        row["decode_speedup"] = row["transformers_decode_ms_per_token"] / row["hybridspec_decode_ms_per_token"]
        row["prefill_speedup"] = row["transformers_prefill_ms_per_token"] / row["hybridspec_prefill_ms_per_token"]
        if any(hasattr(layer.mlp, "experts") for layer in engine.target.layers):
            row["expert_mib_per_token"], row["expert_mib_all"] = expert_bytes(engine, prompt[:16])
        # no float32 decoder that reads each weight once a token is faster than this
        row["weight_mib_per_token"] = decode_weight_mib(model, row)
        row["stream_gb_s"] = streaming_gb_s(1024)
        row["decode_bound_ms"] = row["weight_mib_per_token"] * 2 ** 20 / row["stream_gb_s"] / 1e6
        if peers:
            engine = None  # a peer loads the weights again (vLLM's worker the engine's too) beside the model
            gc.collect()
            release_free_memory()  # the freed engine's pages back to the system before the peer's are taken
            job = {"prompt": prompt, "new": args.new, "repeats": args.repeats, "threads": args.threads}
            row["peers"] = {}
            before = (row["hybridspec_prefill_ms_per_token"], row["hybridspec_decode_ms_per_token"])
            for peer in peers:
                got = row["peers"][peer] = PEERS[peer](model, job)
                print(f"{name}: {peer} {got.get('error') or 'ran'}", file=sys.stderr)
                if "error" in got:
                    continue
                got["same_tokens"] = got.pop("tokens") == reference
                if got.get("in_turns"):
                    continue
                # the engine again right after the peer: its ratio is to the mean of the engine's runs on either
                # side of it (this host's memory bandwidth drifts between minutes)
                after = engine_timings(model, prompt, args.new, args.repeats)
                got["hybridspec_prefill_ms_per_token"] = (before[0] + after[0]) / 2
                got["hybridspec_decode_ms_per_token"] = (before[1] + after[1]) / 2
                got["prefill_ratio"] = got["prefill_ms_per_token"] / got["hybridspec_prefill_ms_per_token"]
                got["decode_ratio"] = got["decode_ms_per_token"] / got["hybridspec_decode_ms_per_token"]
                before = after
        rows.append(row)
        engine = model = None  # the next model is built without this one beside it

    print(f"\n{args.prompt}-token prompt, {args.new} decoded tokens, float32 ({args.values} values), "
          f"{args.threads} threads; ms per token "
          "(transformers / hybridspec = speed-up); float32 read time: the float32 weights a decode token "
          "multiplies at the rate this machine read memory (a sum over 1 GiB), the floor of an engine that reads "
          "each once (the engine's greedy steps read the output layer in int8: `GreedyHead`)\n")
    print("| " + " | ".join(["model", "params (M)", "prefill: transformers", "hybridspec", "speed-up",
                              "decode: transformers", "hybridspec", "speed-up", "float32 read time",
                              *(f"{p}: prefill / decode (its / ours)" for p in peers),
                              "expert weights a token multiplies"]) + " |")
    print("|---" * (10 + len(peers)) + "|")
    for r in rows:
        experts = (f"{r['expert_mib_per_token']:.0f} of {r['expert_mib_all']:.0f} MiB" if "expert_mib_all" in r
                   else "-")
        columns = ["did not run" if "error" in got else
                   f"{got['prefill_ms_per_token']:.2f} / {got['decode_ms_per_token']:.1f} "
                   f"({got['prefill_ratio']:.2f}x / **{got['decode_ratio']:.2f}x**)"
                   for got in (r["peers"][p] for p in peers)]
        print(f"| {r['model']} | {r['params_m']:.0f} | {r['transformers_prefill_ms_per_token']:.2f} | "
              f"{r['hybridspec_prefill_ms_per_token']:.2f} | {r['prefill_speedup']:.2f}x | "
              f"{r['transformers_decode_ms_per_token']:.1f} | {r['hybridspec_decode_ms_per_token']:.1f} | "
              f"**{r['decode_speedup']:.2f}x** | {r['decode_bound_ms']:.1f} ({r['stream_gb_s']:.1f} GB/s) | "
              + " | ".join(columns + [experts]) + " |")
    for r in rows:
        for peer, got in r.get("peers", {}).items():
            if "error" in got:
                print(f"{r['model']}: {peer} did not run: {got['error']}")
    write_json(args.json, {"machine": machine_info(), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
