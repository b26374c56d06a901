"""Tokenizer loading, chat templates and incremental detokenization."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(path: Path, is_gguf: bool):
    """A transformers fast tokenizer, from an HF directory or from a GGUF file's metadata (never a hub)."""
    if is_gguf:
        from specdecode.models.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for missing or broken files
        raise ValueError(f"Could not load a tokenizer from {path}: {e}. The directory needs tokenizer.json "
                         "(or the slow tokenizer's files) next to config.json.") from None


def _tokenizer_files(path: Path, is_gguf: bool) -> list[Path] | None:
    """The files a model's tokenizer vocabulary is read from (for a GGUF file, what its cached conversion
    saved), or None where they are not at hand."""
    if is_gguf:
        from specdecode.models.gguf_loader import cached_tokenizer_json
        f = cached_tokenizer_json(path)
        return [f] if f is not None else None
    files = [Path(path) / "tokenizer.json", Path(path) / "tokenizer_config.json"]
    return files if files[0].is_file() else None


def same_tokenizer_files(a: Path, a_is_gguf: bool, b: Path, b_is_gguf: bool) -> bool:
    """True when two models' tokenizers are read from byte-identical files (a target and a draft of one
    family): they tokenize alike without loading the second one."""
    fa, fb = _tokenizer_files(a, a_is_gguf), _tokenizer_files(b, b_is_gguf)
    if fa is None or fb is None or len(fa) != len(fb):
        return False
    try:
        return all(x.is_file() == y.is_file() and (not x.is_file() or (x.stat().st_size == y.stat().st_size
                                                                       and x.read_bytes() == y.read_bytes()))
                   for x, y in zip(fa, fb))
    except OSError:
        return False


def eos_ids(tokenizer, hf_config: dict) -> set[int]:
    ids: set[int] = set()
    for v in (hf_config.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    gen_cfg = hf_config.get("_generation_eos")
    if gen_cfg:
        ids.update(gen_cfg)
    return ids


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
    """The conversation as the model's template renders it. ``tools`` (OpenAI function definitions) and
    ``template_kwargs`` (e.g. Qwen3's ``enable_thinking``) go to the template, which decides how to show them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("This model's tokenizer has no chat template; use generate() with a plain prompt "
                         "instead of chat().")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts.")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         tools=tools or None, **template_kwargs)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks multi-byte characters and the spacing rules of some tokenizers, so we
    decode a small window of recent tokens twice (with and without the new ones) and emit the difference,
    holding it back while it ends in an incomplete UTF-8 sequence.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        after = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += delta
            return delta
        return ""
