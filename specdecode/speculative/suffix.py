"""Suffix decoding: model-free drafts from the request's own context and from earlier requests' outputs.

After SuffixDecoding (Oliaro et al., arXiv 2411.04975) and vLLM's ``method: "suffix"``. Where the context's
suffix occurred before (in the request's prompt and output so far, or in the outputs of earlier requests,
kept in a global cache of ``max_cached_requests`` requests, oldest dropped first), the continuations of those
occurrences are counted token by token, as a suffix tree's node counts would be: the draft follows the most
frequent continuation for as long as the share of occurrences that agree with it (its estimated
probability) stays at or above ``min_token_prob``. A draft is at most ``max_spec_factor`` times the match
length long, and match plus draft at most ``max_tree_depth`` tokens (vLLM's meaning of the four options).

With adaptive k, how deep a draft goes is decided per token: every drafted token carries its evidence (its
share, whether more than one occurrence backs it, whether the match is long), and the engine-wide acceptance
of tokens with that evidence, learned from every verification, gives each position's chance. A draft thus runs
long where the cache agrees and stops early at a contested token, instead of every position counting at the
request's average rate.

Occurrences are found through an index of every position by the two tokens before it (a suffix tree cut at
depth two, the rest compared in place), which keeps memory at a few words per cached token. Among the
match lengths found, the one whose draft has the highest expected number of accepted tokens (the sum of the
token probabilities) is used: a long match is more reliable, a shorter one may have more occurrences.
"""
from __future__ import annotations

import bisect
from array import array
from collections import OrderedDict

from specdecode.speculative.adaptive import AdaptiveK, prefix_length
from specdecode.speculative.prediction import predicted
from specdecode.speculative.proposer import Proposal, Proposer

# Occurrences looked at per source and step, latest first: a bound on the work of one lookup.
MAX_OCCURRENCES = 64
# Match lengths tried per lookup (the longest ones, plus the one that leaves room for a full draft).
MAX_MATCH_LENGTHS = 4


# Evidence classes of a drafted token: its share (bands below), whether several occurrences back it, and
# whether its match is long. Shares of a few tenths are mostly rejected, full shares of long matches mostly
# accepted; the rates in between are learned.
_SHARE_BANDS = (0.3, 0.6, 0.9)
_LONG_MATCH = 8
_EVIDENCE_DECAY = 0.98   # per observation of a class: it follows the last fifty or so tokens of its kind
_EVIDENCE_PRIOR = 4.0    # pseudo-trials at the token's share (times 0.9) before any are seen


def _key(a: int, b: int) -> int:
    return (a << 32) | b


class _Index:
    """Positions in token sequences by the two tokens before them. A position p is indexed once the token
    at p exists: it is where a match ending at p - 1 continues."""

    def __init__(self):
        self.where: dict[int, array] = {}

    def add(self, tokens, lo: int, hi: int, tag: int = 0) -> None:
        """Index positions lo..hi-1 of ``tokens`` (positions below 2 have no two tokens before them)."""
        for p in range(max(2, lo), hi):
            k = _key(tokens[p - 2], tokens[p - 1])
            arr = self.where.get(k)
            if arr is None:
                arr = self.where[k] = array("q")
            arr.append((tag << 32) | p)

    def remove(self, tokens, lo: int, hi: int, tag: int) -> None:
        for p in range(max(2, lo), hi):
            k = _key(tokens[p - 2], tokens[p - 1])
            arr = self.where.get(k)
            if arr is None:
                continue
            kept = array("q", (e for e in arr if e >> 32 != tag))
            if kept:
                self.where[k] = kept
            else:
                del self.where[k]


class EvidenceRates:
    """Acceptance of drafted tokens by evidence class, learned from verifications, decayed per class."""

    def __init__(self):
        self.counts: dict[tuple, tuple[float, float]] = {}  # class -> (accepted, tried)

    @staticmethod
    def kind(share: float, occurrences: int, match: int) -> tuple[int, bool, bool]:
        return bisect.bisect_right(_SHARE_BANDS, share), occurrences > 1, match >= _LONG_MATCH

    def rate(self, evidence: tuple[float, int, int]) -> float:
        ok, n = self.counts.get(self.kind(*evidence), (0.0, 0.0))
        return (ok + _EVIDENCE_PRIOR * 0.9 * evidence[0]) / (n + _EVIDENCE_PRIOR)

    def observe(self, evidence: tuple[float, int, int], accepted: bool) -> None:
        k = self.kind(*evidence)
        ok, n = self.counts.get(k, (0.0, 0.0))
        self.counts[k] = (_EVIDENCE_DECAY * ok + accepted, _EVIDENCE_DECAY * n + 1.0)


class SuffixCache:
    """The global part: the outputs of the last ``max_requests`` finished requests, each after the end of
    its prompt (so that an output's first tokens are found by how prompts end)."""

    def __init__(self, max_requests: int, depth: int):
        self.max_requests, self.depth = max_requests, depth
        self.index = _Index()
        self.seqs: OrderedDict[int, tuple[array, int]] = OrderedDict()  # tag -> (tokens, first output position)
        self._next = 1

    def add(self, prompt: list[int], output: list[int]) -> None:
        if self.max_requests <= 0 or not output:
            return
        head = prompt[-self.depth:]
        tokens = array("q", head + output)
        tag, self._next = self._next, self._next + 1
        self.seqs[tag] = (tokens, len(head))
        self.index.add(tokens, len(head), len(tokens), tag)
        while len(self.seqs) > self.max_requests:
            old, (toks, start) = self.seqs.popitem(last=False)
            self.index.remove(toks, start, len(toks), old)

    def occurrences(self, key: int):
        arr = self.index.where.get(key)
        if arr is None:
            return
        for e in reversed(arr[-MAX_OCCURRENCES:]):
            yield self.seqs[e >> 32][0], e & 0xFFFFFFFF

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t, _ in self.seqs.values())


class LocalIndex:
    """The request's own prompt and output, indexed as they grow."""

    def __init__(self):
        self.index = _Index()
        self.done = 0

    def update(self, tokens: list[int]) -> None:
        if len(tokens) > self.done:
            self.index.add(tokens, self.done, len(tokens))
            self.done = len(tokens)

    def occurrences(self, key: int, tokens: list[int]):
        arr = self.index.where.get(key)
        if arr is None:
            return
        for e in reversed(arr[-MAX_OCCURRENCES:]):
            yield tokens, e & 0xFFFFFFFF


class SuffixProposer(Proposer):
    """vLLM's ``suffix`` method. Also a lookup source of HybridProposer (``find``)."""

    drafts_by_lookup = True

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, min_match: int = 2, k: int | None = None,
                 policy: AdaptiveK | None = None, cache: SuffixCache | None = None):
        super().__init__(k, policy)
        self.depth = max_tree_depth
        self.spec_factor = max_spec_factor
        self.min_prob = min_token_prob
        self.min_match = max(2, min_match)
        self.cache = cache if cache is not None else SuffixCache(max_cached_requests, max_tree_depth)
        self.evidence = EvidenceRates()

    # ---- the proposer calls ----
    def propose(self, requests: list, budgets: list[int]) -> Proposal:
        return self.propose_lookups(requests, budgets)

    def observe(self, request, drafted: list[int], accepted: int, emitted: list[int]) -> None:
        self.score_found(request, emitted)
        self.policy.learn(request, drafted, accepted, True, [], emitted, None)

    def finish(self, request) -> None:
        super().finish(request)
        self.cache.add(request.prompt_token_ids, request.output_token_ids)
        request.spec.suffix_index = request.spec.suffix_found = None

    # ---- lookup ----
    def find(self, request, tokens: list[int], k: int) -> list[int]:
        """Up to k draft tokens after ``tokens`` (the request's context, possibly extended by drafts). A lookup
        from the request's own context (not one extended by drafts) is kept, with each token's evidence, for
        found_rates and score_found. The request's predicted output, where it has one, comes first."""
        draft, found = predicted(request, tokens, k), None  # a prediction's drafts carry no evidence to score
        if not draft:
            draft, evidence = self._lookup(request, tokens, k)
            found = (draft, evidence)
        # the step's context itself (committed tokens and the engine's prefix), not one extended by drafts
        if len(tokens) == len(request.all_token_ids) + prefix_length(request):
            request.spec.suffix_found = found
        return draft

    def found_rates(self, request, found: list[int]) -> list[float] | None:
        """Each token's chance of acceptance (the tokens before it accepted), by its evidence class."""
        last = request.spec.suffix_found
        if not found or last is None or last[0] != found:
            return None
        return [self.evidence.rate(e) for e in last[1]]

    def score_found(self, request, emitted: list[int]) -> None:
        """Teach the evidence rates what the target emitted after the step's lookup, drafted or not: a
        token counts while every one before it matched (for a one-hot draft, matching the emitted token is
        the acceptance test)."""
        last = request.spec.suffix_found
        request.spec.suffix_found = None
        if not last:
            return
        for tok, ev, out in zip(last[0], last[1], emitted):
            self.evidence.observe(ev, tok == out)
            if tok != out:
                break

    def _lookup(self, request, tokens: list[int], k: int) -> tuple[list[int], list[tuple[float, int, int]]]:
        """``find``'s draft, with each token's evidence: (share, occurrences behind the draft, match length)."""
        n = len(tokens)
        if k <= 0 or n < 2:
            return [], []
        local = request.spec.suffix_index
        if local is None:
            local = request.spec.suffix_index = LocalIndex()
        local.update(request.all_token_ids)
        key = _key(tokens[-2], tokens[-1])
        depth = self.depth
        found = []  # (match length, sequence, position of the continuation), the request's own first
        for seq, p in list(local.occurrences(key, tokens)) + list(self.cache.occurrences(key)):
            m = 2
            while m < depth and p - 1 - m >= 0 and m < n and seq[p - 1 - m] == tokens[n - 1 - m]:
                m += 1
            if m >= self.min_match and p < len(seq):
                found.append((m, seq, p))
        if not found:
            return [], []
        lengths = sorted({m for m, _, _ in found}, reverse=True)[:MAX_MATCH_LENGTHS]
        roomy = min(lengths[0], depth - k)  # the longest match that leaves room for k draft tokens
        if roomy >= self.min_match and roomy not in lengths:
            lengths.append(roomy)
        best, best_shares, best_score, best_m, best_total = [], [], 0.0, 0, 0
        for m in sorted(lengths, reverse=True):
            room = min(k, int(self.spec_factor * m), depth - m)
            if room <= len(best):
                continue
            occ = [(s, p) for mm, s, p in found if mm >= m]
            draft, shares = self._follow(occ, room)
            score = sum(shares)
            if score > best_score:
                best, best_shares, best_score, best_m, best_total = draft, shares, score, m, len(occ)
        return best, [(sh, best_total, best_m) for sh in best_shares]

    def _follow(self, occ: list, room: int) -> tuple[list[int], list[float]]:
        """The most frequent continuation of the occurrences ``occ`` (latest first), token by token, while
        the share of occurrences that agree with it stays >= min_token_prob; and those shares (their sum is
        the expected number of accepted tokens)."""
        total = len(occ)
        out: list[int] = []
        shares: list[float] = []
        live = occ
        for j in range(room):
            counts: dict[int, int] = {}
            for seq, p in live:
                if p + j < len(seq):
                    t = seq[p + j]
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            tok = max(counts, key=counts.get)  # ties: the latest occurrence's token
            prob = counts[tok] / total
            if prob < self.min_prob:
                break
            out.append(int(tok))
            shares.append(prob)
            live = [(seq, p) for seq, p in live if p + j < len(seq) and seq[p + j] == tok]
        return out, shares
