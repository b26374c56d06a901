"""Logits processing shared by plain sampling, the draft model and the rejection sampler.

Everything is row-wise, so a row's result never depends on the other rows in the batch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Collection, Sequence

import torch

from specdecode.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specdecode.outputs import Logprob


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    history: list[list[int]]) -> torch.Tensor:
    """Presence / frequency / repetition penalties; history[i] is the output so far as seen by row i."""
    if not any(p.has_penalties for p in params):
        return logits
    logits = logits.clone()
    for i, (p, hist) in enumerate(zip(params, history)):
        if not p.has_penalties or not hist:
            continue
        ids = torch.tensor(hist, device=logits.device)
        counts = torch.zeros(logits.shape[-1], device=logits.device).scatter_add_(
            0, ids, torch.ones_like(ids, dtype=torch.float32))
        seen = counts > 0
        row = logits[i]
        if p.repetition_penalty != 1.0:
            row = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty), row)
        row = row - p.frequency_penalty * counts - p.presence_penalty * seen.float()
        logits[i] = row
    return logits


def apply_logit_bias(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One request's rows [N, V] with its logit_bias added to every row (OpenAI: before sampling)."""
    if not p.logit_bias:
        return logits
    V = logits.shape[-1]
    outside = [t for t in p.logit_bias if t >= V]
    if outside:
        raise ValueError(f"logit_bias names token id {outside[0]}, outside the vocabulary (ids 0..{V - 1}).")
    ids = torch.tensor(list(p.logit_bias), device=logits.device)
    bias = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=logits.device)
    logits = logits.float().clone()
    logits[:, ids] += bias
    return logits


def apply_min_tokens(logits: torch.Tensor, p: SamplingParams, num_output: int,
                     eos_ids: Collection[int]) -> torch.Tensor:
    """One request's rows [N, V], row j following num_output + j output tokens: rows before min_tokens cannot
    end the request, so its stop tokens (stop_token_ids, and EOS unless ignore_eos) get -inf there (vLLM)."""
    n = min(logits.shape[0], p.min_tokens - num_output)
    if n <= 0:
        return logits
    V = logits.shape[-1]
    ids = sorted(t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)) if 0 <= t < V)
    if not ids:
        return logits
    logits = logits.float().clone()
    logits[:n, torch.tensor(ids, device=logits.device)] = float("-inf")
    return logits


def apply_token_bans(logits: torch.Tensor, p: SamplingParams, histories: list[list[int]] | None,
                     bad_words_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Rows [N, V] with what may not come next at -inf: every token outside ``allowed_token_ids``, and for each
    bad word's token sequence, its last token where the row's history ends with the rest of it."""
    if not p.allowed_token_ids and not bad_words_ids:
        return logits
    logits = logits.float().clone()
    if p.allowed_token_ids:
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[torch.tensor(p.allowed_token_ids, device=logits.device)] = True
        logits[:, ~keep] = float("-inf")
    for j, history in enumerate(histories if bad_words_ids else ()):
        banned = [w[-1] for w in bad_words_ids if len(w) == 1 or _ends_with(history, w[:-1])]
        if banned:
            logits[j, banned] = float("-inf")
    return logits


def _ends_with(history: list[int], head: Sequence[int]) -> bool:
    return len(history) >= len(head) and history[len(history) - len(head):] == list(head)


def request_logits(rows: torch.Tensor, p: SamplingParams, output: list[int], drafts: Sequence[int],
                   eos_ids: Collection[int],
                   grammar_mask: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   bad_words_ids: Sequence[Sequence[int]] = ()) -> torch.Tensor:
    """One request's verification logits [len(drafts) + 1, V] -> the logits its sampling transform takes.

    Row j is the target's distribution after ``output + drafts[:j]``, so everything that depends on the
    output so far is applied per row with that history: this is what keeps speculation exact (a draft that
    plain decoding could not produce at its position gets probability 0 and is rejected). vLLM's order:
    allowed_token_ids and bad_words, logit_bias, min_tokens, penalties; then the grammar's mask. A grammar
    outranks min_tokens: where it allows nothing but stopping, the request stops (rather than having no token
    to sample). ``bad_words_ids``: the token sequences of p.bad_words (``InputProcessor.bad_words_ids``)."""
    # each row's history, where bad words or penalties read it
    history = ([output + list(drafts[:j]) for j in range(rows.shape[0])]
               if p.has_penalties or bad_words_ids else None)
    rows = apply_token_bans(rows, p, history, bad_words_ids)
    rows = apply_logit_bias(rows, p)
    blocked = apply_min_tokens(rows, p, len(output), eos_ids)

    def penalized(x: torch.Tensor) -> torch.Tensor:
        return apply_penalties(x, [p] * x.shape[0], history) if p.has_penalties else x

    out = penalized(blocked)
    if (p.allowed_token_ids or bad_words_ids) and bool(torch.isneginf(out).all(-1).any()):
        raise SamplingError("allowed_token_ids, bad_words and min_tokens leave no token that may come next.")
    if grammar_mask is None:
        return out
    masked = grammar_mask(out)
    if blocked is not rows:
        dead = masked.amax(-1) == float("-inf")  # rows where min_tokens left the grammar nothing
        if bool(dead.any()):
            masked = torch.where(dead[:, None], grammar_mask(penalized(rows)).float(), masked.float())
    return masked


_ARGMAX_CHUNK = 128


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (the first maximal index) for rows over a large vocabulary, several times faster on CPU.

    torch's CPU argmax walks a row element by element (about 0.3 ms for 152k logits here), while a max is
    vectorized: take each chunk's max, the first chunk holding the row's max, then the argmax inside it."""
    shape, V = x.shape[:-1], x.shape[-1]
    if V <= 4 * _ARGMAX_CHUNK:
        return x.argmax(-1)
    rows = x.reshape(-1, V)
    if V % _ARGMAX_CHUNK:
        rows = torch.nn.functional.pad(rows, (0, _ARGMAX_CHUNK - V % _ARGMAX_CHUNK), value=float("-inf"))
    chunks = rows.view(rows.shape[0], -1, _ARGMAX_CHUNK)
    c = chunks.amax(-1).argmax(-1)
    inside = chunks[torch.arange(rows.shape[0], device=x.device), c].argmax(-1)
    return (c * _ARGMAX_CHUNK + inside).view(shape)


class SamplingError(ValueError):
    """A request's numbers gave no distribution to sample from (non-finite logits after its penalties and
    temperature). The engine fails that request alone."""


def top_probability(logits: torch.Tensor) -> float | None:
    """The softmax's largest probability for one row of logits [V] (None if the row is not finite). A policy's
    signal, not a result: on CPU the kernel extension computes it with a fast exp (to about 1e-6)."""
    top = None
    if logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 1 and logits.is_contiguous():
        from specdecode.layers import kernels

        top = kernels.top_probability(logits)  # -1.0 for a row that is not finite
    if top is None:
        lg = logits.float()
        top = float(torch.exp(lg.max() - torch.logsumexp(lg, -1)))
    return top if 0.0 <= top <= 1.0 else None


def logits_to_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, then softmax. Greedy rows get a one-hot argmax.

    Raises SamplingError when a row has no valid distribution, so that a bad request cannot hand NaN to the
    rejection sampler, where it would fail the whole batch."""
    logits = logits.float()
    probs = torch.empty_like(logits)
    for i, p in enumerate(params):
        row = logits[i]
        if p.greedy:
            probs[i] = torch.zeros_like(row).scatter_(0, argmax(row).view(1), 1.0)
            continue
        row = row / p.temperature
        if 0 < p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        pr = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            pr = _top_p(pr, p.top_p)
        if p.min_p > 0.0:
            pr = pr.masked_fill(pr < p.min_p * pr.max(), 0.0)
        probs[i] = pr / pr.sum()
    if not bool(torch.isfinite(probs.sum(-1)).all()):  # a NaN or an infinity makes its row's sum non-finite
        raise SamplingError("The sampling parameters gave non-finite probabilities (check temperature and the "
                            "penalties).")
    return probs


def _top_p(pr: torch.Tensor, top_p: float) -> torch.Tensor:
    """pr [V] restricted to its nucleus: the smallest set of most likely tokens whose mass reaches top_p (the
    token that crosses it stays). Sorting a whole large vocabulary per row costs far more on CPU than the rest
    of sampling (docs/benchmarks.md, session 19), and a nucleus is small: it is looked for among the tokens
    within 1e-4 of the most likely one where they are few, else among the top 256 tokens, then 4x as many, and
    so on. A candidate set that does not contain the crossing token is never used."""
    few = pr >= pr.max() * 1e-4
    if int(few.sum()) <= 1024:
        found = _nucleus(pr, few.nonzero().squeeze(1), top_p)
        if found is not None:
            return found
    n = min(256, pr.numel())
    while True:
        top, idx = pr.topk(n)
        found = _nucleus(pr, idx, top_p, top)
        if found is not None:  # always, once the candidates are the whole row
            return found
        n = min(4 * n, pr.numel())


def _nucleus(pr: torch.Tensor, cand: torch.Tensor, top_p: float,
             top: torch.Tensor | None = None) -> torch.Tensor | None:
    """pr restricted to the nucleus if it lies within the candidate ids ``cand`` (``top``: their probabilities
    in descending order, if known), else None."""
    if top is None:
        top, order = pr[cand].sort(descending=True, stable=True)
        cand = cand[order]
    # keep a prefix of the sorted candidates: those whose mass before them is still below top_p
    keep = (top.cumsum(0) - top) < top_p
    keep[0] = True  # the most likely token always stays (a top_p below float32's range is 0)
    if bool(keep[-1]) and cand.numel() < pr.numel():
        return None  # the nucleus may go on past the candidates
    return torch.zeros_like(pr).index_copy_(0, cand[keep], top[keep])


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs [V] (any nonnegative weights): the token whose interval of the cumulative sum holds
    a uniform draw. It replaces torch.multinomial, which is many times slower on CPU over a large vocabulary
    and runs once per emitted token and per draft-model guess (docs/benchmarks.md, session 19). The sum runs in
    float64, so every token keeps its share to far below sampling noise; a token of weight 0 has an empty
    interval and is never drawn."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).item())


_MASK64 = 2 ** 64 - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class PositionNoise:
    """A seeded request's randomness: one vector of Exp(1) noise per output position, a function of the seed
    and the position alone. The token at a position is argmax(p / noise) (the exponential race: token i wins
    with probability p_i), so a seeded request's output is a function of its seed and its distributions only.

    Why not a generator's stream: with speculation, how many draws a step takes depends on its drafts, and
    those depend on what the proposer learned from other requests and on the batch. Drawn per position, the
    same seed gives the same text with or without speculation, in any batch, after any earlier requests. The
    draft model draws its guess for a position with the same noise as the verifier, so a draft that agrees
    with the target's distribution is accepted as often as the two agree."""

    def __init__(self, seed: int):
        self.seed = seed & _MASK64
        self._rows: dict[tuple[int, int], torch.Tensor] = {}

    def row(self, position: int, size: int, device: torch.device | str) -> torch.Tensor:
        key = (position, size)
        noise = self._rows.get(key)
        if noise is None:  # (a request's rows all live on one device)
            g = torch.Generator(device=device)
            g.manual_seed(_splitmix64(self.seed ^ _splitmix64(position)))
            # -log(u) for u in [0, 1): never 0, so a token of probability 0 scores 0 and is never chosen
            noise = torch.rand(size, generator=g, device=device).log_().neg_()
            self._rows[key] = noise
        return noise

    def scores(self, probs: torch.Tensor, start: int) -> torch.Tensor:
        """probs [n, V] for the positions start.. -> scores whose row argmax is each position's token."""
        return probs / torch.stack([self.row(start + j, probs.shape[-1], probs.device) for j in range(len(probs))])

    def choose(self, probs: torch.Tensor, position: int) -> int:
        return int(argmax(probs / self.row(position, probs.shape[-1], probs.device)))

    def forget_before(self, position: int) -> None:
        """Positions before this one are committed: their noise is never read again."""
        for key in [k for k in self._rows if k[0] < position]:
            del self._rows[key]


def logprobs_of(logits: torch.Tensor, tokens: Sequence[int], top_n: int,
                decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob]]:
    """Per row of logits [N, V]: the Logprob (log probability, rank, text) of the row's token ``tokens[i]`` and
    of the row's ``top_n`` most likely tokens, as vLLM reports them."""
    from specdecode.outputs import Logprob

    lp = torch.log_softmax(logits.float(), dim=-1)
    tok = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)[:, None]
    chosen = lp.gather(-1, tok)
    ranks = ((lp > chosen).sum(-1) + 1).tolist()
    top = lp.topk(top_n) if top_n > 0 else None
    out = []
    for i, t in enumerate(tokens):
        t = int(t)
        row = {t: Logprob(float(chosen[i, 0]), ranks[i], decode(t) if decode else None)}
        if top is not None:
            for r, (v, u) in enumerate(zip(top.values[i].tolist(), top.indices[i].tolist()), start=1):
                if u not in row:
                    row[u] = Logprob(v, r, decode(u) if decode else None)
        out.append(row)
    return out
