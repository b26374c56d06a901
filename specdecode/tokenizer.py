"""Tokenizer loading, chat templates and incremental detokenization."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterable


def load_tokenizer(path: Path, is_gguf: bool):
    """A transformers fast tokenizer, from an HF directory or from a GGUF file's metadata (never a hub)."""
    if is_gguf:
        from specdecode.models.gguf_tokenizer import load_gguf_tokenizer
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for missing or broken files
        raise ValueError(f"Could not load a tokenizer from {path}: {e}. The directory needs tokenizer.json "
                         "(or the slow tokenizer's files) next to config.json.") from None


class SavedTokenizer:
    """A tokenizer read straight from a saved tokenizer.json by the ``tokenizers`` library, with chat templates
    rendered by :mod:`specdecode.chat_template`: what serving needs, without importing transformers (about a
    second of every start-up).

    It stands in for transformers' ``TokenizersBackend`` where the saved config holds nothing beyond the
    special tokens and the length (the tokenizers specdecode saves for GGUF files), so encode, decode and the
    templates give the same results. Anything else (``tokenizer(text)``, ``save_pretrained``, xgrammar)
    goes to the transformers tokenizer, built from the same folder on first use: :attr:`hf`.
    """

    SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
    _KNOWN_KEYS = frozenset(SPECIAL) | {"backend", "model_max_length", "is_local", "local_files_only",
                                        "tokenizer_class", "added_tokens_decoder", "clean_up_tokenization_spaces"}
    # apply_chat_template options only transformers implements
    _HF_ONLY = frozenset({"documents", "chat_template", "continue_final_message", "return_dict", "return_tensors",
                          "return_assistant_tokens_mask", "sanitize_control_tokens", "padding", "truncation",
                          "max_length", "tokenizer_kwargs"})

    _LONG_TEXT = 16384  # characters

    def __init__(self, backend, config: dict[str, Any], chat_template: str | None, folder: Path,
                 name_or_path: str):
        self._backend = backend
        self._folder = folder
        self._hf = None
        self._hf_lock = threading.Lock()
        self.name_or_path = name_or_path
        self.chat_template = chat_template
        self.model_max_length: int = config.get("model_max_length", int(1e30))
        self.special_tokens_map: dict[str, str] = {k: config[k] for k in self.SPECIAL if config.get(k) is not None}
        for k in self.SPECIAL:
            setattr(self, k, config.get(k))

    @classmethod
    def usable(cls, config: dict[str, Any]) -> bool:
        """True when transformers would add nothing to the tokenizer.json for this config."""
        return (set(config) <= cls._KNOWN_KEYS
                and config.get("tokenizer_class", "TokenizersBackend") in ("TokenizersBackend", "PreTrainedTokenizerFast")
                and config.get("backend", "tokenizers") == "tokenizers"
                and not config.get("clean_up_tokenization_spaces", False)
                and all(isinstance(config.get(k), (str, type(None))) for k in cls.SPECIAL))

    @classmethod
    def from_folder(cls, folder: Path, name_or_path: str, backend=None) -> "SavedTokenizer | None":
        """The folder's tokenizer, or None when its config needs transformers. ``backend``: the folder's
        tokenizer.json already parsed (``tokenizers.Tokenizer.from_file``)."""
        config = json.loads((folder / "tokenizer_config.json").read_text())
        if not cls.usable(config):
            return None
        if backend is None:
            from tokenizers import Tokenizer
            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        template = folder / "chat_template.jinja"  # a config key "chat_template" fails usable()
        return cls(backend, config, template.read_text() if template.is_file() else None, folder, name_or_path)

    # -- what the engine, the server and the proposers use
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > self._LONG_TEXT:
            # encode holds the GIL for all of it (a second per megabyte); encode_batch gives the same ids without
            # it, so the engine thread keeps stepping the running streams while a long prompt is split.
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode([int(ids)] if isinstance(ids, int) else [int(i) for i in ids],
                                    skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        ids = map(int, ids)
        if skip_special_tokens:
            skip = set(self.all_special_ids)
            ids = (i for i in ids if i not in skip)
        return list(map(self._backend.id_to_token, ids))

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=False)

    @property
    def added_tokens_decoder(self) -> dict:
        return self._backend.get_added_tokens_decoder()

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [self._backend.token_to_id(t) for t in self.all_special_tokens]

    def __getattr__(self, name: str):
        if name.endswith("_token_id") and name[:-3] in SavedTokenizer.SPECIAL:
            token = self.__dict__.get(name[:-3])
            return None if token is None else self._backend.token_to_id(token)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, **kwargs: Any):
        """transformers' call: ``tokenize=False`` renders here; other outputs and options go to :attr:`hf`."""
        if tokenize or self._HF_ONLY.intersection(kwargs) or not isinstance(self.chat_template, str):
            return self.hf.apply_chat_template(conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                                               tokenize=tokenize, **kwargs)
        from specdecode.chat_template import render

        return render(self.chat_template, conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                      special_tokens=self.special_tokens_map, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any):
        return self.hf(*args, **kwargs)

    @property
    def hf(self):
        """transformers' tokenizer for the same files (built on first use, then kept)."""
        with self._hf_lock:
            if self._hf is None:
                from specdecode.models.gguf_tokenizer import load_saved_hf_tokenizer

                tok = load_saved_hf_tokenizer(self._folder)
                tok.name_or_path = self.name_or_path
                self._hf = tok
            return self._hf


def hf_tokenizer(tokenizer):
    """transformers' object for a tokenizer: :attr:`SavedTokenizer.hf`, or the tokenizer itself."""
    return tokenizer.hf if isinstance(tokenizer, SavedTokenizer) else tokenizer


def _tokenizer_files(path: Path, is_gguf: bool) -> list[Path] | None:
    """The files a model's tokenizer vocabulary is read from (for a GGUF file, what its cached conversion
    saved), or None where they are not at hand."""
    if is_gguf:
        from specdecode.models.gguf_tokenizer import cached_tokenizer_json
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


def encode_text(tokenizer, text: str) -> list[int]:
    """A prompt's token ids, with the special tokens the tokenizer adds (a BOS for llama-style models). A chat
    template usually writes the BOS into the text itself; then the BOS the tokenizer adds would be a second one,
    which the model never saw in training, so it is dropped (llama.cpp warns of the same double BOS)."""
    ids = tokenizer.encode(text)
    bos, bos_text = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "bos_token", None)
    if (bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos and isinstance(bos_text, str) and bos_text
            and text.startswith(bos_text)):
        return ids[1:]
    return ids


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                        **template_kwargs: Any) -> str:
    """The conversation as the model's template renders it. ``tools`` (OpenAI function definitions) and
    ``template_kwargs`` (e.g. Qwen3's ``enable_thinking``) go to the template, which decides how to show them.
    ``continue_final_message``: the text ends with the last message's content, open, so the model goes on
    writing it (a reply's first words given by the caller); as in vLLM, add_generation_prompt must then be off."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("This model's tokenizer has no chat template; use generate() with a plain prompt "
                         "instead of chat().")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message continues the last message and add_generation_prompt (true by "
                         "default) starts a new one: set add_generation_prompt to false.")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         tools=tools or None, **template_kwargs)
    return _open_final_message(text, messages[-1]) if continue_final_message and messages else text


def _open_final_message(text: str, final: dict[str, Any]) -> str:
    """``text`` cut right after the last message's content, whatever the template writes after it (the end of
    its turn). The content's trailing whitespace stays where the template kept it."""
    content = final.get("content")
    if isinstance(content, list):  # text parts
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    body = content.strip() if isinstance(content, str) else ""
    if not body:
        raise ValueError("continue_final_message needs a last message with text to continue.")
    at = text.rfind(body)
    if at < 0:
        raise ValueError("continue_final_message: this chat template does not write the last message's text as "
                         "given, so the text cannot be continued.")
    end = at + len(body)
    for ch in content[len(content.rstrip()):]:
        if end < len(text) and text[end] == ch:
            end += 1
        else:
            break
    return text[:end]


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
