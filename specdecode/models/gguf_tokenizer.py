"""A tokenizer from a GGUF file's metadata (no hub access), and the cache that saves it once it is built.

Building one converts the whole vocabulary with transformers, which takes seconds; the result is saved beside the
packed-weight cache and later loads read the saved files.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdecode.models.families import GGUF_ARCHITECTURES
from specdecode.models.gguf_loader import open_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


def load_gguf_tokenizer(path: str | os.PathLike, cache: bool | None = None):
    """A tokenizer built from the GGUF's metadata (no hub access), with its chat template, BOS, EOS and padding
    tokens set from that metadata: transformers' fast tokenizer when it is first built, and a
    :class:`~specdecode.tokenizer.SavedTokenizer` of the same files when it is loaded from the cache.

    Building it converts the whole vocabulary, which takes seconds; the result is saved (tokenizer.json and its
    config) beside the packed-weight cache, keyed by the file's path, size and mtime, and later calls load that.
    ``cache`` False, or ``$SPECDECODE_PACKED_CACHE=0``, skips the cache."""
    from specdecode.models import packed_cache

    p = Path(path)
    if not p.is_file() or not (packed_cache.enabled() if cache is None else cache):
        return _build_gguf_tokenizer(p)
    import json
    import logging
    import shutil

    ident, folder = _tokenizer_folder(p)
    done = folder / "identity.json"
    if done.is_file():
        try:
            marker = json.loads(done.read_text())
            if marker.get("identity") != ident:
                raise ValueError("its identity file does not match")
            digest = _saved_digest(folder)
            if digest != marker.get("content"):
                raise ValueError("its files fail their checksum")
            return _tokenizer_for(digest, folder, p)
        except Exception as e:  # a damaged folder: rebuild it
            logging.getLogger("specdecode").warning("Cached tokenizer %s is unusable (%s: %s); rebuilding it.",
                                                    folder, type(e).__name__, str(e)[:200])
            shutil.rmtree(folder, ignore_errors=True)
    tok = _build_gguf_tokenizer(p)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        tok.save_pretrained(str(tmp))
        # Written last: marks the folder complete.
        (tmp / "identity.json").write_text(json.dumps({"identity": ident, "content": _saved_digest(tmp)}))
        try:
            os.rename(tmp, folder)
        except OSError:  # another process got there first (or a stale folder is in the way)
            if not done.is_file():
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(tmp, folder)
    except OSError:
        pass  # the cache is an optimisation: a read-only or full disk only costs the rebuild next time
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tok.name_or_path = str(p)
    return tok


def _tokenizer_folder(p: Path) -> tuple[str, Path]:
    """(identity, folder) of the cached tokenizer of GGUF file ``p``."""
    import hashlib
    import json

    from specdecode.models import packed_cache

    ident = json.dumps([_TOKENIZER_CACHE_VERSION, packed_cache.source_identity(p)])
    return ident, packed_cache.cache_root().parent / "tokenizers" / (
        f"{p.name.removesuffix('.gguf')}.{hashlib.sha256(ident.encode()).hexdigest()[:16]}")


def cached_tokenizer_json(path: str | os.PathLike) -> Path | None:
    """The tokenizer.json that load_gguf_tokenizer saved for GGUF file ``path``, if a complete one is cached."""
    from specdecode.models import packed_cache

    p = Path(path)
    if not p.is_file() or not packed_cache.enabled():
        return None
    folder = _tokenizer_folder(p)[1]
    f = folder / "tokenizer.json"
    return f if (folder / "identity.json").is_file() and f.is_file() else None


def _saved_digest(folder: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        f = folder / name
        h.update(name.encode() + b"\0" + (f.read_bytes() if f.is_file() else b"") + b"\0")
    return h.hexdigest()


# Tokenizers loaded in this process, by the digest of their saved files: a target and a draft of one family
# carry the same tokenizer, and the second one costs a copy instead of another parse.
_LOADED_TOKENIZERS: dict[str, Any] = {}


def _tokenizer_for(digest: str, folder: Path, source: Path):
    """The saved tokenizer as a :class:`~specdecode.tokenizer.SavedTokenizer` where its config allows (no
    transformers import), else transformers' tokenizer."""
    import copy

    from specdecode.tokenizer import SavedTokenizer

    first = _LOADED_TOKENIZERS.get(digest)
    if first is None:
        first = SavedTokenizer.from_folder(folder, str(source)) or load_saved_hf_tokenizer(folder)
        _LOADED_TOKENIZERS[digest] = first
    if isinstance(first, SavedTokenizer):
        # The Rust vocabulary, which nothing mutates, is shared.
        return SavedTokenizer.from_folder(folder, str(source), backend=first._backend)
    # Each caller gets its own object (its own special-token maps and settings); the Rust vocabulary is shared.
    tok = copy.copy(first)
    tok.__dict__.update({k: copy.copy(v) for k, v in first.__dict__.items() if isinstance(v, (dict, list, set))})
    tok.name_or_path = str(source)
    return tok


_TOKENIZER_CACHE_VERSION = 3  # 3: Gemma files without a chat template get Gemma's
_NOT_INIT_KWARGS = {"added_tokens_decoder", "tokenizer_class", "backend", "is_local", "local_files_only",
                    "name_or_path", "auto_map"}


def load_saved_hf_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """What ``save_pretrained`` wrote, as transformers' tokenizer, with tokenizer.json parsed once (by the
    tokenizers library): from_pretrained also parses it in Python, and passing a tokenizer_object deep-copies it."""
    import json

    from transformers import PreTrainedTokenizerFast

    kwargs = {k: v for k, v in json.loads((folder / "tokenizer_config.json").read_text()).items()
              if k not in _NOT_INIT_KWARGS}
    template = folder / "chat_template.jinja"
    if template.is_file():
        kwargs["chat_template"] = template.read_text()
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **kwargs)


def _build_gguf_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    p, mm, meta, _ = open_gguf(path)
    mm.close()
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{p} has no tokenizer in its metadata (tokenizer.ggml.tokens); pass the model's "
                         "HF directory instead.")
    from transformers import PreTrainedTokenizerFast

    try:
        with tempfile.TemporaryDirectory(prefix="specdecode-gguf-tok-") as tmp:
            # Alone in a folder, so a tokenizer.json or tokenizer_config.json next to the file cannot take over.
            folder, name = Path(tmp), "model.gguf"
            try:
                (folder / name).symlink_to(p.resolve())
            except OSError:
                folder, name = p.parent, p.name
            # This class converts just the tokenizer; AutoTokenizer would first parse the whole file for a config.
            tok = PreTrainedTokenizerFast.from_pretrained(str(folder), gguf_file=name, local_files_only=True)
    except Exception as e:  # transformers raises many exception types for unsupported tokenizers
        raise ValueError(f"Could not build a tokenizer from {p}: {type(e).__name__}: {e}. Pass the model's HF "
                         "directory (with tokenizer.json) instead.") from None
    tok.name_or_path = str(p)
    family = GGUF_ARCHITECTURES.get(meta.get("general.architecture"))
    template = meta.get("tokenizer.chat_template") or (family.chat_template if family else None)
    if template:
        tok.chat_template = template
    for attr, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"), ("unk_token", "unknown")):
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(idx, int) and 0 <= idx < len(tokens):
            setattr(tok, attr, tokens[idx])
    ctx = meta.get(f"{meta.get('general.architecture')}.context_length")
    if isinstance(ctx, int):
        tok.model_max_length = ctx
    return tok
