"""Tiny randomly initialised models of every native family, saved in the HF layout, for fast tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 512
FAMILIES = ("llama", "qwen2", "qwen3", "opt", "gpt2")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Speculative decoding drafts tokens cheaply and verifies them in one pass.",
    "Once upon a time there was a small model that wanted to be fast.",
    "Les modèles de langue prédisent le prochain jeton. 日本語のテキストも少し。",
]


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_model(family: str, out: Path, seed: int = 0, layers: int = 2, hidden: int = 64,
                overrides: dict | None = None) -> Path:
    """overrides: config values over the defaults below (Gemma only)."""
    import transformers as T

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family in ("llama", "qwen2", "qwen3"):
        cls_cfg = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config}[family]
        extra = {"head_dim": 32} if family == "qwen3" else {}
        cfg = cls_cfg(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=family == "qwen2", **extra, **common)
        if family == "llama":  # exercise llama3 rope scaling
            cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}
    elif family == "opt":
        cfg = T.OPTConfig(hidden_size=hidden, ffn_dim=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                          max_position_embeddings=1024, word_embed_proj_dim=hidden, **common)
    elif family == "gpt2":
        cfg = T.GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=1024, **common)
    elif family in ("gemma2", "gemma3"):  # not in FAMILIES: tests/test_families.py builds them (4 layers)
        # A window of 8 (prompts run past it), sliding and global layers, query_pre_attn_scalar != head_dim.
        extra = (dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      layer_types=["sliding_attention", "full_attention"] * (layers // 2)) if family == "gemma2" else
                 dict(layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                      rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
        cls_cfg = T.Gemma2Config if family == "gemma2" else T.Gemma3TextConfig
        extra.update(overrides or {})
        cfg = cls_cfg(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      **{"query_pre_attn_scalar": 24, "sliding_window": 8, "max_position_embeddings": 1024, **extra},
                      **common)
    else:
        raise ValueError(family)
    model = T.AutoModelForCausalLM.from_config(cfg)
    # Random init gives near-uniform logits; sharper ones make greedy tests meaningful and sampling non-trivial.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
            elif family.startswith("gemma"):  # norm weights (stored as w, scaling by 1 + w) away from zero
                p.normal_(0.0, 0.5)
    model.save_pretrained(str(out))
    build_tokenizer(out)
    return out
