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
