"""A small draft model proposes k tokens autoregressively on its own KV cache, batched over requests."""
from __future__ import annotations

import torch
import torch.nn as nn

from specdecode.engine.model_runner import ModelRunner
from specdecode.layers.linear import Linear
from specdecode.layers.sampler import argmax, logits_to_probs, sample
from specdecode.spec.proposer import Proposal


def draft_vocab_ids(tokenizer, eos_token_ids: set[int], size: int, vocab: int) -> torch.Tensor:
    """Token ids a truncated draft head keeps: 0..size-1 plus every special / added token and EOS."""
    extra = set(eos_token_ids) | set(getattr(tokenizer, "all_special_ids", []) or [])
    extra |= set((getattr(tokenizer, "added_tokens_decoder", None) or {}).keys())
    ids = sorted(set(range(min(size, vocab))) | {int(i) for i in extra if 0 <= int(i) < vocab})
    return torch.tensor(ids, dtype=torch.long)


class TruncatedHead(nn.Module):
    """An LM head that scores only ``keep``; every other token gets logit -inf, i.e. probability 0.

    The draft then proposes from (and reports the probabilities of) this restricted distribution, which the
    rejection sampler handles like any other draft distribution: output stays exactly the target's."""

    def __init__(self, head: Linear, keep: torch.Tensor, vocab: int):
        super().__init__()
        self.sub = head.select_rows(keep)
        self.vocab = vocab
        device = head.weight.device if head.weight is not None else head.packed.device
        self.register_buffer("keep", keep.to(device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sub = self.sub(x)
        out = sub.new_full((*sub.shape[:-1], self.vocab), float("-inf"))
        out[..., self.keep] = sub
        return out


class DraftModelProposer:
    """k autoregressive draft steps, batched over requests.

    With ngram_first the engine may hand over drafts it looked up in a request's context (prompt lookup):
    in text that copies from its context they are as good as the draft model's and cost nothing. Those
    drafts are one-hot, as the n-gram proposer's are, and the draft model catches up on them at its next
    step."""

    def __init__(self, runner: ModelRunner, target_vocab: int, p_min: float = 0.0,
                 vocab_ids: torch.Tensor | None = None):
        self.runner = runner
        self.vocab = target_vocab
        self.p_min = p_min
        model = runner.model
        if vocab_ids is not None and len(vocab_ids) < model.args.vocab_size:
            model.lm_head = TruncatedHead(model.lm_head, vocab_ids, model.args.vocab_size)

    def _catch_up(self, requests: list) -> list[torch.Tensor]:
        """Feed each request's tokens the draft has not seen; return each one's next-token logits [V]."""
        out: list[torch.Tensor | None] = [None] * len(requests)
        rows, idx = [], []
        for i, r in enumerate(requests):
            pending = r.all_token_ids[r.draft_computed:]
            if r.draft_computed == 0:
                out[i] = self.runner.prefill(r.slot, pending)
            else:
                rows.append((r.slot, r.draft_computed, pending))
                idx.append(i)
            r.draft_computed = len(r.all_token_ids)
        if rows:
            for i, lg in zip(idx, self.runner.forward_rows(rows, all_logits=False)):
                out[i] = lg[0]
        return out

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        # Embedding tables may be padded differently; the token ids that matter are shared.
        v = logits.shape[-1]
        if v == self.vocab:
            return logits
        if v > self.vocab:
            return logits[..., :self.vocab]
        pad = logits.new_full((*logits.shape[:-1], self.vocab - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def propose(self, requests: list, ks: list[int], lookups: list[list[int]] | None = None) -> Proposal:
        """Up to ks[i] draft-model tokens per request; ``lookups[i]``, where not empty, are drafts the engine
        already copied from request i's context (ngram_first), passed through with one-hot probabilities."""
        if not lookups or not any(lookups):
            return self._draft(requests, ks)
        prop = self._draft(requests, [0 if found else k for found, k in zip(lookups, ks)])
        probs = prop.probs
        width = max(len(t) for t in lookups + prop.tokens)
        if probs is not None:  # some sampled request used the draft model: give looked-up drafts one-hot rows
            pad = max(0, width - probs.shape[1])  # the draft may have stopped early (p_min): never negative
            probs = torch.cat([probs, probs.new_zeros(len(requests), pad, self.vocab)], 1)
            for i, found in enumerate(lookups):
                if found and not requests[i].params.greedy:
                    probs[i, torch.arange(len(found)), torch.tensor(found)] = 1.0
        return Proposal([found or drafted for found, drafted in zip(lookups, prop.tokens)], probs)

    def _draft(self, requests: list, ks: list[int]) -> Proposal:
        active = [i for i, k in enumerate(ks) if k > 0]
        tokens: list[list[int]] = [[] for _ in requests]
        kmax = max(ks, default=0)
        need_probs = any(not requests[i].params.greedy for i in active)
        probs = (torch.zeros(len(requests), kmax, self.vocab, device=self.runner.device)
                 if need_probs and kmax else None)
        if not active:
            return Proposal(tokens, probs)
        logits = dict(zip(active, self._catch_up([requests[i] for i in active])))
        for step in range(kmax):
            feed = []
            for i in list(active):
                r = requests[i]
                lg = self._fit_vocab(logits[i].float())
                if r.params.greedy:
                    tok = int(argmax(lg))
                    if self.p_min > 0 and float(torch.softmax(lg, -1)[tok]) < self.p_min and step > 0:
                        active.remove(i)  # the draft is unsure: verifying more would likely be wasted
                        continue
                else:
                    p = logits_to_probs(lg[None], [r.params])[0]
                    tok = sample(p, r.generator)
                    probs[i, step] = p
                tokens[i].append(tok)
                if len(tokens[i]) >= ks[i]:
                    active.remove(i)
                else:
                    feed.append(i)
            if not feed:
                break
            outs = self.runner.forward_rows(
                [(requests[i].slot, requests[i].draft_computed, [tokens[i][-1]]) for i in feed], all_logits=False)
            for i, lg in zip(feed, outs):
                requests[i].draft_computed += 1
                logits[i] = lg[0]
        return Proposal(tokens, probs)

    def rollback(self, request, valid_len: int) -> None:
        request.draft_computed = min(request.draft_computed, valid_len)
