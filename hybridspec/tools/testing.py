"""Small random models for fast tests of anything that runs a target model."""
from __future__ import annotations

import torch

SMOLLM2_VOCAB_SIZE = 49152


def tiny_llama(vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 6, num_heads: int = 4,
               num_kv_heads: int = 2, intermediate_size: int = 128, max_position_embeddings: int = 512,
               seed: int = 0, dtype: torch.dtype = torch.float32, init_std: float = 0.3, eos_token_id: int = 2):
    """A random LlamaForCausalLM in eval mode (SDPA attention), deterministic in `seed`.

    A larger `init_std` than Llama's 0.02 makes next-token distributions peaked and varied, so greedy decoding does
    not collapse into one repeated token and sampling tests see distributions far from uniform.
    Use vocab_size=SMOLLM2_VOCAB_SIZE to pair it with the SmolLM2 tokenizer. Needs num_layers >= 4 for the hidden
    states drafters read (inputs of layers 2, L//2, L-3).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, initializer_range=init_std, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=eos_token_id, pad_token_id=eos_token_id, tie_word_embeddings=False,
        attn_implementation="sdpa")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


# The architectures `tiny_causal_lm` builds, each small and with one of every layer kind its family has.
TINY_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_window", "mistral_window", "gpt_oss", "gemma3",
                      "qwen3_5", "qwen3_5_moe", "qwen3_next")


def tiny_causal_lm(arch: str, vocab_size: int = 128, num_layers: int = 6, seed: int = 0, init_std: float = 0.3,
                   window: int = 12, dtype: torch.dtype = torch.float32, eos_token_id: int = 2):
    """A random model of one of TINY_ARCHITECTURES from transformers' own config classes, in eval mode (SDPA):
    "qwen2" with q/k/v biases; "qwen3" with q/k norms; "qwen3_moe" with 8 experts, 2 a token, layer 1 dense;
    "qwen3_window" full attention in its first half and a sliding window of `window` positions in the rest;
    "mistral_window" that window in every layer; "gpt_oss" with sinks, the window in every other layer, 8 experts, 2 a
    token, YaRN (eager attention, its reference in transformers); "gemma3" with its four norms a layer, GELU, scaled
    embeddings, query_pre_attn_scalar and local layers windowed with their own rotary base; "qwen3_5" Gated DeltaNet
    and gated full attention in turn (partial RoPE, 2 key heads to 4 value heads); "qwen3_5_moe" that with 8 experts,
    2 a token, and a gated shared expert; "qwen3_next" that MoE (layer 2 dense) with Qwen3-Next's fused projections.
    Norm weights are random too (a wrong permutation of them shows)."""
    if arch == "llama":
        return tiny_llama(vocab_size=vocab_size, num_layers=num_layers, seed=seed, dtype=dtype, init_std=init_std,
                          eos_token_id=eos_token_id)
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=init_std, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=eos_token_id,
                  pad_token_id=eos_token_id, tie_word_embeddings=False, attn_implementation="sdpa")
    if arch == "qwen2":
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif arch in ("qwen3", "qwen3_window"):
        sliding = dict(use_sliding_window=True, sliding_window=window, max_window_layers=num_layers // 2) \
            if arch == "qwen3_window" else {}
        config, cls = transformers.Qwen3Config(head_dim=16, **sliding, **common), transformers.Qwen3ForCausalLM
    elif arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(head_dim=16, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[1],
                                             norm_topk_prob=True, **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "gpt_oss":
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 128}
        config = transformers.GptOssConfig(**{**common, "attn_implementation": "eager"}, head_dim=16,
                                           num_local_experts=8, num_experts_per_tok=2, sliding_window=window,
                                           rope_parameters=rope)
        cls = transformers.GptOssForCausalLM
    elif arch == "gemma3":
        config = transformers.Gemma3TextConfig(**{k: v for k, v in common.items() if k != "tie_word_embeddings"},
                                               head_dim=16, sliding_window=window, query_pre_attn_scalar=32,
                                               sliding_window_pattern=2)
        cls = transformers.Gemma3ForCausalLM
    elif arch in ("qwen3_5", "qwen3_5_moe"):
        hybrid = dict(head_dim=16, linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
                      linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"] * (num_layers // 2))
        if arch == "qwen3_5":
            config, cls = transformers.Qwen3_5TextConfig(**hybrid, **common), transformers.Qwen3_5ForCausalLM
        else:
            config = transformers.Qwen3_5MoeTextConfig(**hybrid, **common, num_experts=8, num_experts_per_tok=2,
                                                       moe_intermediate_size=32, shared_expert_intermediate_size=48)
            cls = transformers.Qwen3_5MoeForCausalLM
    elif arch == "qwen3_next":  # Qwen3.5's layers with fused, key-head-grouped DeltaNet projections; MoE, a dense layer
        config = transformers.Qwen3NextConfig(
            head_dim=16, linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"] * (num_layers // 2),
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2], **common)
        cls = transformers.Qwen3NextForCausalLM
    elif arch == "mistral_window":
        config, cls = transformers.MistralConfig(sliding_window=window, **common), transformers.MistralForCausalLM
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; one of {TINY_ARCHITECTURES}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1 + 0.3 * torch.randn_like(param))
                elif name.endswith("bias") or name.endswith("sinks"):
                    param.copy_(0.3 * torch.randn_like(param))
    return model.to(dtype).eval()


TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer(vocab_size: int = 128):
    """A character-level fast tokenizer: ids 0-2 are <unk>, <|im_start|>, <|im_end|> (EOS), then printable ASCII.

    Pairs with `tiny_llama(vocab_size)`: every id below vocab_size decodes, so random models' outputs are text, and
    it has a ChatML template like SmolLM2's.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    chars += [f"<x{i}>" for i in range(max(0, vocab_size - len(specials) - len(chars)))]
    vocab = {tok: i for i, tok in enumerate((specials + chars)[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def chi_square_p_value(counts, probs) -> float:
    """Pearson's goodness-of-fit p-value of observed `counts` against cell probabilities `probs` (aligned sequences),
    pooling the cells expected below 5 times into one (observations in impossible cells land there too)."""
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    expected = probs * counts.sum()
    big = expected >= 5
    stat = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    cells = int(big.sum())
    pooled_obs, pooled_exp = float(counts[~big].sum()), float(expected[~big].sum())
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    elif pooled_obs > 0:  # observations where none were possible
        return 0.0
    return float(torch.special.gammaincc(torch.tensor((cells - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
