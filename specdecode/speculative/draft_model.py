"""A small draft model proposes k tokens autoregressively on its own KV cache, batched over requests."""
from __future__ import annotations

import time
from typing import Callable, Protocol

import torch

from specdecode.layers.sampler import argmax, logits_to_probs, sample
from specdecode.models.model import CausalLM
from specdecode.speculative.adaptive import AdaptiveK
from specdecode.speculative.draft_vocab import TruncatedHead, expand, top_token
from specdecode.speculative.proposer import (Proposal, Proposer, context_of, one_hot_rows, reads_draft_probs,
                                             widened)


# More unseen tokens than this (a prompt after a prefix-cache hit) are fed as a prefill, not as decode rows.
PREFILL_ROWS = 32
# The bounded draft context (StreamingLLM's attention sinks plus a recent window): the first DRAFT_SINKS tokens
# and the last draft_window to 2 x draft_window. DEFAULT_DRAFT_WINDOW is measured (docs/long_context.md).
DRAFT_SINKS = 16
DEFAULT_DRAFT_WINDOW = 1024


class DraftRunner(Protocol):
    """What the proposer needs of the draft model's runner (engine.model_runner.ModelRunner, which the engine
    builds and hands to ``build_proposer``): its model, whose head it swaps, and passes over its KV cache."""

    model: CausalLM
    device: torch.device

    def prefill(self, slot: int, token_ids: list[int], start: int = 0) -> torch.Tensor:
        """Computes KV for token_ids at positions start.. and returns the last token's logits [V]."""
        ...

    def forward_rows(self, seqs: list[tuple[int, int, list[int]]],
                     all_logits: bool | list[bool]) -> list[torch.Tensor]:
        """seqs: (slot, start position, new tokens); per sequence the logits [len(tokens), V] if all_logits,
        else the last row's [1, V]."""
        ...


class DraftModelProposer(Proposer):
    """k autoregressive draft steps, batched over requests (vLLM's ``draft_model`` method).

    HybridProposer calls ``draft`` directly with drafts it looked up in a request's context: in text that
    copies from its context they are as good as the draft model's and cost nothing. Those drafts are
    one-hot, as the n-gram proposer's are, and the draft model catches up on them at its next step.

    The draft runs over a request's prompt lazily, at the first step that needs it (a request the draft
    model never drafts for never pays for it); that time is counted in ``prefill_seconds``.

    Bounded context (``window`` W > 0). A context longer than DRAFT_SINKS + W is seen by the draft as its
    first DRAFT_SINKS tokens (attention sinks) followed by its last W tokens, at positions re-indexed from 0, in
    blocks private to the slot (engine.block_pool: the draft's window). New tokens extend that view until it holds
    2W recent tokens; then it is rebuilt from the last W (a prefill of W tokens every W tokens generated). So
    the draft's prefill and its per-step attention stay bounded whatever the prompt's length. Drafts only move
    speed: the target verifies every token. ``request.draft_computed`` keeps counting real positions; the
    slot's window offset maps them to the draft's."""

    def __init__(self, runner: DraftRunner, target_vocab: int, p_min: float = 0.0,
                 vocab_ids: torch.Tensor | None = None, confidence: float = 0.0, k: int | None = None,
                 policy: AdaptiveK | None = None, heads: dict[bytes, TruncatedHead] | None = None,
                 window: int = DEFAULT_DRAFT_WINDOW):
        super().__init__(k, policy)
        self.runner = runner
        self.window = window
        # the policy prices a catch-up and a draft step by the draft's context: at most this many tokens
        self.policy.draft_context = DRAFT_SINKS + 2 * window if window else 0
        self.policy.draft_catch_up = DRAFT_SINKS + window if window else 0
        self.vocab = target_vocab
        self.p_min = p_min
        self.confidence = confidence
        self.full_head = runner.model.lm_head if not isinstance(runner.model.lm_head, TruncatedHead) \
            else runner.model.lm_head.source
        # Truncated heads by vocabulary; proposers over one draft model share them (and their context tokens).
        self._heads = heads if heads is not None else {}
        self._prefill_seconds = 0.0
        self.head = self.full_head
        self.set_vocab(vocab_ids)

    @property
    def draft_runner(self) -> DraftRunner:
        return self.runner

    @property
    def prefill_seconds(self) -> float:
        return self._prefill_seconds

    @property
    def draft_head(self) -> torch.nn.Module:
        return self.head

    def head_identity(self) -> str | None:
        if not isinstance(self.head, TruncatedHead):
            return None
        import hashlib
        compact = ":compact" if self.head.compact else ""  # no vocabulary-wide row per step: a cheaper step
        return (f"{len(self.head.keep)}:" + hashlib.sha256(self.head.keep.cpu().numpy().tobytes()).hexdigest()[:16]
                + compact)

    def set_vocab(self, vocab_ids: torch.Tensor | None) -> None:
        """Score only ``vocab_ids`` (plus each request's context tokens) in the draft's LM head; None: all.
        Heads are kept per vocabulary, so switching back and forth (the bench does) costs nothing."""
        vocab = self.runner.model.args.vocab_size
        if vocab_ids is None or len(vocab_ids) >= vocab:
            self.head = self.full_head
        else:
            key = vocab_ids.cpu().numpy().tobytes()
            if key not in self._heads:
                # compact: _draft reads its logits with the ids they came with
                self._heads[key] = TruncatedHead(self.full_head, vocab_ids, vocab, compact=True)
            self.head = self._heads[key]
        self.runner.model.lm_head = self.head

    def _note_context(self, token_ids: list[int]) -> None:
        if isinstance(self.head, TruncatedHead):
            self.head.add_context(token_ids)

    def _scored(self) -> torch.Tensor | None:
        """The token ids of the logits the draft's last pass gave: None for vocabulary-wide logits."""
        return self.head.ids if isinstance(self.head, TruncatedHead) and self.head.compact else None

    def _offset(self, request) -> int:
        """Real position - the draft's position, for the request's tokens past the sinks (0: no window)."""
        pool = self._pool()
        offset = pool.window(request.slot) if pool is not None else None
        return offset or 0

    def _pool(self):
        return getattr(getattr(self.runner, "kv_cache", None), "pool", None)

    def _rebuild(self, request, n: int) -> bool:
        """Whether the draft's view of a context of n tokens must be (re)built as sinks + the last W: it would
        take a catch-up longer than a window, or hold more than 2W recent tokens, or what it holds no longer
        covers the window's start (a rollback below it)."""
        if not self.window or n <= DRAFT_SINKS + self.window or self._pool() is None:
            return False
        offset = self._pool().window(request.slot)
        if offset is None:
            return n - request.draft_computed > self.window or n > DRAFT_SINKS + 2 * self.window
        return n - offset > DRAFT_SINKS + 2 * self.window or request.draft_computed < offset + DRAFT_SINKS

    def _prefill_window(self, request, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The draft's view rebuilt as the sinks plus the last W tokens of ``tokens`` (the sinks are kept when a
        window is open already); None when the pool cannot spare the window's blocks."""
        n, pool, slot = len(tokens), self._pool(), request.slot
        base = n - self.window
        fresh = pool.window(slot) is None
        if not pool.open_window(slot, base - DRAFT_SINKS, DRAFT_SINKS + 2 * self.window):
            return None
        feed = tokens[:DRAFT_SINKS] + tokens[base:] if fresh else tokens[base:]
        request.draft_computed = n
        return self.runner.prefill(slot, feed, 0 if fresh else DRAFT_SINKS), self._scored()

    def _prefill_draft(self, request) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the draft over the request's tokens it has not seen (after a prefix the prefix cache gave it,
        if any) as a prompt prefill, or rebuild its bounded view of them; the logits after them, and their
        token ids (``_scored``)."""
        t0 = time.perf_counter()
        tokens = list(context_of(request))
        self._note_context(tokens)
        out = self._prefill_window(request, tokens) if self._rebuild(request, len(tokens)) else None
        if out is None:
            start = request.draft_computed
            request.draft_computed = len(tokens)
            offset = self._offset(request)
            out = self.runner.prefill(request.slot, tokens[start:], start - offset), self._scored()
        self._prefill_seconds += time.perf_counter() - t0
        return out

    def _catch_up(self, requests: list) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Feed each request's tokens the draft has not seen; return each one's next-token logits and their token
        ids (``_scored``)."""
        out: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * len(requests)
        rows, idx = [], []
        for i, r in enumerate(requests):
            context = context_of(r)
            pending = context[r.draft_computed:]
            if r.draft_computed == 0 or len(pending) > PREFILL_ROWS or self._rebuild(r, len(context)):
                out[i] = self._prefill_draft(r)
                continue
            self._note_context(pending)
            rows.append((r.slot, r.draft_computed - self._offset(r), pending))
            idx.append(i)
            r.draft_computed = len(context)
        if rows:
            outs = self.runner.forward_rows(rows, all_logits=False)
            ids = self._scored()
            for i, lg in zip(idx, outs):
                out[i] = lg[0], ids
        return out

    def warm_up(self, requests: list) -> None:
        """Feed the draft the tokens it has not seen of ``requests`` without drafting (their step drafts from a
        lookup), so that its next draft for them starts without a catch-up."""
        if requests:
            self.runner.model.lm_head = self.head
            self._catch_up(requests)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        # Embedding tables may be padded differently; the token ids that matter are shared.
        v = logits.shape[-1]
        if v == self.vocab:
            return logits
        if v > self.vocab:
            return logits[..., :self.vocab]
        pad = logits.new_full((*logits.shape[:-1], self.vocab - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def propose(self, requests: list, budgets: list[int]) -> Proposal:
        caps = self.caps(budgets)
        ks = [k for _, k in self.policy.plan(requests, budgets, [0] * len(requests), caps)]
        # With a confidence threshold the draft's own probabilities decide how deep it goes: adaptive k only
        # decides whether the draft model runs at all.
        return self.draft(requests, [cap if k else 0 for k, cap in zip(ks, caps)] if self.confidence else ks)

    def observe(self, request, drafted: list[int], accepted: int, emitted: list[int]) -> None:
        self.policy.learn(request, drafted, accepted, False, [], emitted, None)

    def draft(self, requests: list, ks: list[int], lookups: list[list[int]] | None = None,
              extend: Callable[[int, list[int]], list[int]] | None = None) -> Proposal:
        """Up to ks[i] draft-model tokens per request; ``lookups[i]``, where not empty, are drafts already
        copied from request i's context, passed through with one-hot probabilities. ``extend(i, drafted)``,
        called after each draft-model token, may return tokens copied from the context after ``drafted``
        (the draft has just opened a span seen before); they end request i's draft."""
        lookups = lookups or [[] for _ in requests]
        prop = self._draft(requests, [0 if found else k for found, k in zip(lookups, ks)], extend)
        if not any(lookups):
            return prop
        probs = prop.probs
        if probs is not None:  # some sampled request used the draft model: give looked-up drafts one-hot rows
            probs = widened(probs, max(len(t) for t in lookups + prop.tokens))
            for i, found in enumerate(lookups):
                if found and reads_draft_probs(requests[i]):
                    probs = one_hot_rows(probs, i, 0, found)
        return Proposal([found or drafted for found, drafted in zip(lookups, prop.tokens)], probs)

    def _stop_before(self, i: int, step: int, top_p: float, cum: list[float]) -> bool:
        """Whether request i stops before drafting token ``step``, whose most likely candidate has
        probability top_p. Decided before that token is drawn, so for sampled requests the verifier still sees
        an unbiased draft at every position it gets (any stopping rule that does not look at the token being
        proposed keeps rejection sampling exact)."""
        cum[i] *= top_p
        if step == 0:
            return False  # the first token is nearly free to verify (a second row costs ~5% of a pass)
        # p_min: this token alone is unlikely (llama.cpp); confidence: the draft's own estimate that all
        # its tokens so far are accepted has fallen too low for another one to pay.
        return top_p < self.p_min or cum[i] < self.confidence

    def _draft(self, requests: list, ks: list[int],
               extend: Callable[[int, list[int]], list[int]] | None = None) -> Proposal:
        active = [i for i, k in enumerate(ks) if k > 0]
        tokens: list[list[int]] = [[] for _ in requests]
        self.runner.model.lm_head = self.head  # proposers that share this draft model may use other heads
        need_probs = any(reads_draft_probs(requests[i]) for i in active)
        if not active:
            return Proposal(tokens, None)
        kmax = max(ks)
        probs = torch.zeros(len(requests), kmax, self.vocab, device=self.runner.device) if need_probs else None
        logits = dict(zip(active, self._catch_up([requests[i] for i in active])))
        cum = [1.0] * len(requests)
        stopping = self.p_min > 0 or self.confidence > 0
        for step in range(kmax):
            feed = []
            for i in list(active):
                r = requests[i]
                lg, ids = logits[i]
                tok = top_token(lg, ids, self.vocab) if ids is not None and r.params.greedy and not stopping else None
                top = 1.0
                if tok is None:  # a vocabulary-wide row: a full head, a sampled request, a stopping rule, a NaN
                    lg = self._fit_vocab(lg.float() if ids is None else expand(lg, ids, self.vocab))
                    if r.params.greedy:
                        tok = int(argmax(lg))
                        top = float(torch.softmax(lg, -1)[tok]) if stopping else 1.0
                    else:
                        p = logits_to_probs(lg[None], [r.params])[0]
                        top = float(p.max()) if stopping else 1.0
                if stopping and self._stop_before(i, step, top, cum):
                    active.remove(i)
                    continue
                if not r.params.greedy:  # drawn only now: whether to draft it did not depend on it
                    # a seeded request's guess uses the noise the verifier will use at that position
                    noise = r.noise
                    tok = (sample(p, None) if noise is None
                           else noise.choose(p, r.num_output_tokens + len(r.draft_prefix) + len(tokens[i])))
                    if probs is not None and reads_draft_probs(r):
                        probs[i, step] = p
                tokens[i].append(tok)
                copied = extend(i, tokens[i]) if extend is not None else []
                if copied:
                    tokens[i] += copied
                    if probs is not None and reads_draft_probs(r):
                        probs = one_hot_rows(probs, i, len(tokens[i]) - len(copied), copied)
                if copied or len(tokens[i]) >= ks[i]:
                    active.remove(i)
                else:
                    feed.append(i)
            if not feed:
                break
            outs = self.runner.forward_rows(
                [(requests[i].slot, requests[i].draft_computed - self._offset(requests[i]), [tokens[i][-1]])
                 for i in feed], all_logits=False)
            ids = self._scored()
            for i, lg in zip(feed, outs):
                requests[i].draft_computed += 1
                logits[i] = lg[0], ids
        return Proposal(tokens, probs)

    def rollback(self, request, valid_len: int) -> None:
        request.draft_computed = min(request.draft_computed, valid_len)
