"""Which tokens a truncated draft LM head scores (FR-Spec-style hot vocabulary), and the head itself.

A small draft spends a large share of each step in its LM head (about a quarter of the 0.5B Qwen draft's
weight bytes). Scoring only tokens that are frequent in ordinary text, plus the tokens already in each
request's own context, keeps nearly every token the target will emit within reach at a fraction of that
cost. The draft then proposes from a restricted distribution, which the rejection sampler handles like any
other: the output stays exactly the target's."""
from __future__ import annotations

import gzip
import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn as nn

from specdecode.layers.linear import Linear

# Rankings that ship with the package, each valid for the tokenizers whose strings for its ids match.
BUILTIN_RANKINGS = [Path(__file__).with_name("data") / "qwen2_sharegpt_ranking.json.gz"]


def ranking_fingerprint(tokenizer, ids: list[int]) -> str:
    """sha256 of the token strings of ``ids`` in order: a ranking is only meaningful for a tokenizer that
    maps those ids to the same strings (added tokens and vocabulary padding may differ)."""
    tokens = tokenizer.convert_ids_to_tokens([int(i) for i in ids])
    return hashlib.sha256("\n".join(str(t) for t in tokens).encode()).hexdigest()


def _read_map(path: Path) -> tuple[list[int], str | None]:
    if path.suffix == ".pt":  # SGLang's --speculative-token-map format: a 1-D tensor of token ids
        t = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point():
            raise ValueError(f"{path}: a .pt token map must hold a 1-D integer tensor of token ids.")
        return t.tolist(), None
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    if isinstance(data, dict):
        return data.get("token_ids"), data.get("fingerprint")
    return data, None


def load_token_map(path: str | Path, tokenizer, vocab: int) -> list[int]:
    """Token ids from a token map file, most frequent first: a JSON list, a JSON object with "token_ids"
    (and optionally the "fingerprint" this module writes), either of them gzipped, or a .pt tensor."""
    path = Path(path)
    try:
        ids, fingerprint = _read_map(path)
    except FileNotFoundError:
        raise ValueError(f"Token map {path} does not exist.") from None
    except (OSError, EOFError, ValueError, RuntimeError) as e:  # unreadable, not gzip/JSON, or not a tensor
        raise ValueError(f"Could not read token map {path}: {e}") from None
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids)):
        raise ValueError(f"Token map {path} must list token ids in [0, {vocab}) for this model "
                         "(a JSON list, or an object with \"token_ids\").")
    if fingerprint is not None and fingerprint != ranking_fingerprint(tokenizer, ids):
        raise ValueError(f"Token map {path} was built for a different tokenizer: its ids name other tokens "
                         "in this model's vocabulary. Rebuild it with `specdecode token-map`.")
    return ids


def builtin_ranking(tokenizer, vocab: int) -> list[int] | None:
    """The shipped frequency ranking that fits this tokenizer, if any."""
    for path in BUILTIN_RANKINGS:
        ids, fingerprint = _read_map(path)
        if max(ids) < vocab and ranking_fingerprint(tokenizer, ids) == fingerprint:
            return ids
    return None


def draft_vocab_ids(tokenizer, eos_token_ids: set[int], size: int | None, vocab: int,
                    ranking: list[int] | None = None) -> torch.Tensor:
    """Token ids a truncated draft head keeps, sorted: the ``size`` first of ``ranking`` (all of it when size
    is None), topped up with the lowest ids (a BPE vocabulary's earliest merges) when the ranking is shorter
    or missing, plus every special / added token and EOS."""
    keep: set[int] = set()
    for i in ranking or ():
        if size is not None and len(keep) >= size:
            break
        keep.add(int(i))
    next_id = 0
    while size is not None and len(keep) < min(size, vocab):
        keep.add(next_id)
        next_id += 1
    extra = set(eos_token_ids) | set(getattr(tokenizer, "all_special_ids", []) or [])
    extra |= set((getattr(tokenizer, "added_tokens_decoder", None) or {}).keys())
    keep |= {int(i) for i in extra if 0 <= int(i) < vocab}
    return torch.tensor(sorted(keep), dtype=torch.long)


def draft_head_ids(spec, tokenizer, eos_token_ids: set[int], vocab: int) -> torch.Tensor | None:
    """The ids a SpeculativeConfig's truncated draft head keeps, or None for the full head."""
    if spec.token_map is None and spec.draft_vocab_size is None:
        return None
    ranking = (load_token_map(spec.token_map, tokenizer, vocab) if spec.token_map is not None
               else builtin_ranking(tokenizer, vocab))
    size = spec.head_size(ranking is not None)  # "auto": truncate only where a ranking is known
    if size is None and spec.token_map is None:
        return None
    return draft_vocab_ids(tokenizer, eos_token_ids, size, vocab, ranking)


def token_frequencies(tokenizer, texts: Iterable[str], vocab: int, batch: int = 1000) -> torch.Tensor:
    """How often each token id occurs in ``texts`` (for building a token map)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    chunk: list[str] = []

    def flush() -> None:
        for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
            t = torch.tensor([i for i in ids if 0 <= i < vocab], dtype=torch.long)
            counts.index_add_(0, t, torch.ones_like(t))
        chunk.clear()

    for text in texts:
        chunk.append(text)
        if len(chunk) >= batch:
            flush()
    if chunk:
        flush()
    return counts


def write_token_map(path: str | Path, tokenizer, counts: torch.Tensor, source: str, top: int | None = None) -> int:
    """Write the ids that occur at all (the ``top`` most frequent, if given), most frequent first, with the
    tokenizer fingerprint; returns their number. The file is gzipped JSON when ``path`` ends in .gz."""
    order = torch.argsort(counts, descending=True, stable=True)
    seen = int((counts > 0).sum())
    ids = order[: min(seen, top or seen)].tolist()
    data = {"token_ids": ids, "fingerprint": ranking_fingerprint(tokenizer, ids), "source": source,
            "tokens_counted": int(counts.sum())}
    raw = json.dumps(data, separators=(",", ":")).encode()
    Path(path).write_bytes(gzip.compress(raw, mtime=0) if str(path).endswith(".gz") else raw)
    return len(ids)


class TruncatedHead(nn.Module):
    """An LM head that scores only ``keep`` and the context tokens added with ``add_context``; every other
    token gets logit -inf, i.e. probability 0."""

    def __init__(self, head: Linear, keep: torch.Tensor, vocab: int, max_context_tokens: int = 2048,
                 compact: bool = False):
        super().__init__()
        self.sub = head.select_rows(keep)
        self.vocab = vocab
        device = head.weight.device if head.weight is not None else head.packed.device
        self.register_buffer("keep", keep.to(device), persistent=False)
        self._kept = set(keep.tolist())
        # The full head stays outside the module tree: it is only read to copy rows for context tokens, never
        # per step, so weight-traffic and memory accounting must not count it as part of the draft pass.
        self.__dict__["source"] = head
        self.max_context_tokens = max_context_tokens
        self.context_ids: list[int] = []
        self._recent: OrderedDict[int, None] = OrderedDict()  # context tokens, least recently seen first
        self.context_head: Linear | None = None
        self.register_buffer("context_index", torch.zeros(0, dtype=torch.long, device=device), persistent=False)
        # compact: forward gives only the scored tokens' logits, in the order of ``ids`` (the kept tokens, then
        # the context tokens): a draft step that only needs the top token then neither writes a vocabulary-wide
        # row of -inf nor scans one. ``ids`` is replaced, never changed in place, so a caller may keep it with
        # the logits it came with.
        self.compact = compact
        self.ids = self.keep

    def add_context(self, token_ids: Iterable[int]) -> None:
        """Also score these tokens from now on: a request's own prompt and output are where rare tokens
        (names, identifiers) the target will repeat come from."""
        recent, changed = self._recent, False
        for t in token_ids:
            t = int(t)
            if t in self._kept or not 0 <= t < self.vocab:
                continue
            changed |= t not in recent
            recent[t] = None
            recent.move_to_end(t)
        # A long-running server would otherwise grow this set without bound: forget the tokens seen least
        # recently, which belong to requests that finished long ago, never the running ones' newest.
        while len(recent) > self.max_context_tokens:
            recent.popitem(last=False)
        if not changed:
            return
        index = torch.tensor(sorted(recent), dtype=torch.long)
        self.context_ids = index.tolist()
        self.context_head = self.source.select_rows(index)
        self.context_index = index.to(self.keep.device)
        self.ids = torch.cat([self.keep, self.context_index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sub = self.sub(x)
        scored = sub if self.context_head is None else torch.cat([sub, self.context_head(x).to(sub.dtype)], -1)
        return scored if self.compact else expand(scored, self.ids, self.vocab)


def _in_vocab(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact logits and their ids without the ids at or above ``vocab``."""
    inside = ids < vocab
    if bool(inside.all()):
        return logits, ids
    return logits[..., inside], ids[inside]


def expand(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Compact logits (a TruncatedHead's, scored tokens ``ids``) as a vocabulary-wide row: -inf elsewhere; ids
    at or above ``vocab`` are left out."""
    out = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))
    logits, ids = _in_vocab(logits, ids, vocab)
    out[..., ids] = logits
    return out


def top_token(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> int | None:
    """The vocabulary-wide argmax of compact logits (the lowest id among the maximal ones, as argmax over the
    expanded row gives) without expanding them; None where the logits hold a NaN (argmax's own rule then)."""
    logits, ids = _in_vocab(logits, ids, vocab)
    hit = ids[logits == logits.max()]
    return int(hit.min()) if hit.numel() else None
