"""Fill in the middle: a code model writes the text between a prefix and a suffix (an editor's cursor).

Code models trained for it read ``<prefix token> prefix <suffix token> suffix <middle token>`` and write the
middle, ending it with their end-of-text token. The three tokens are found in the vocabulary by their known
spellings; the prompt is built from token ids, so the prefix and the suffix are each tokenized on their own, as
llama.cpp's infill does.
"""
from __future__ import annotations

from dataclasses import dataclass

# (prefix, suffix, middle) as each family's vocabulary spells them; every family here reads them in this order.
FIM_SPELLINGS: tuple[tuple[str, str, str], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),    # Qwen2.5-Coder, Qwen3-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),          # StarCoder, StarCoder2, Granite Code
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),          # SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),       # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),                            # Code Llama
    ("<PRE>", "<SUF>", "<MID>"),
)


@dataclass(frozen=True)
class FimTokens:
    """The ids of a vocabulary's three fill-in-the-middle tokens."""
    prefix: int
    suffix: int
    middle: int


def _token_id(tokenizer, token: str) -> int | None:
    """The id of ``token`` if the vocabulary has exactly that token. Some tokenizers answer an unknown token with
    their unk id, so the id is checked by converting it back."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(tid, int) or tid < 0:
        return None
    return tid if tokenizer.convert_ids_to_tokens(tid) == token else None


def find_fim_tokens(tokenizer) -> FimTokens | None:
    """The vocabulary's fill-in-the-middle tokens, or None if it has no complete set of a known spelling."""
    for spelling in FIM_SPELLINGS:
        ids = [_token_id(tokenizer, t) for t in spelling]
        if all(i is not None for i in ids):
            return FimTokens(*ids)
    return None


def fim_prompt_ids(tokenizer, tokens: FimTokens, prefix_ids: list[int], suffix: str) -> list[int]:
    """The prompt that asks for the middle between ``prefix_ids`` (already tokenized, without the tokenizer's
    added BOS) and ``suffix``. A tokenizer that starts every text with a BOS gets it in front, as plain prompts
    do."""
    suffix_ids = tokenizer.encode(suffix, add_special_tokens=False) if suffix else []
    bos = getattr(tokenizer, "bos_token_id", None)
    lead = [bos] if bos is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos] else []
    return [*lead, tokens.prefix, *prefix_ids, tokens.suffix, *suffix_ids, tokens.middle]


def known_spellings() -> str:
    """The prefix tokens searched for, for error messages."""
    return ", ".join(s[0] for s in FIM_SPELLINGS)
