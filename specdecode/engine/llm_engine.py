"""The engine step loop: admit and prefill, propose, verify in one target pass, rejection-sample, commit."""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from specdecode.config import EngineConfig, check_draft_compatible
from specdecode.engine.model_runner import ModelRunner
from specdecode.engine.request import Request, Status
from specdecode.engine.scheduler import QueueFullError, Scheduler
from specdecode.layers.sampler import apply_penalties, logits_to_probs, logprobs_of
from specdecode.models.loader import load_model
from specdecode.outputs import RequestOutput
from specdecode.sampling_params import SamplingParams, check_text
from specdecode.speculative.adaptive import CostModel, calibrate, choose_k, next_k
from specdecode.speculative.metrics import SpecDecodeStats
from specdecode.speculative.ngram import ngram_lookup
from specdecode.speculative.proposer import Proposal
from specdecode.speculative.rejection_sampler import rejection_sample
from specdecode.structured.speculation import commit_token, constrain_proposal, mask_rows, matcher_of
from specdecode.tokenizer import eos_ids, load_tokenizer

logger = logging.getLogger("specdecode")

__all__ = ["LLMEngine", "QueueFullError"]


@dataclass
class StepDrafts:
    """One step's drafts and where they came from, so that adaptive k learns each kind's acceptance."""
    proposal: Proposal
    looked_up: list[bool]            # request i's drafts were looked up in its context
    found: list[list[int]]           # ngram_first: the lookup that matched at the step's start, used or not
    copied_from: list[int | None]    # ngram_first: where a copy opened by the draft model's tokens begins


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from specdecode.models.resolve import resolve_model

        self.config = c = config
        if c.num_threads:
            torch.set_num_threads(c.num_threads)
        torch.manual_seed(c.seed)
        t0 = time.perf_counter()
        target_path = resolve_model(c.model, "target")
        target = load_model(target_path, c.dtype, c.device, c.max_model_len, c.quantization)
        self.max_model_len = target.max_model_len
        self.tokenizer = load_tokenizer(target_path, target.is_gguf)
        self.target = ModelRunner(target, c.max_num_seqs, self.max_model_len, c.device)
        self.eos_token_ids = eos_ids(self.tokenizer, target.hf_config)
        self.model_path = target_path
        self.proposer = None
        spec = c.speculative
        if spec is not None and spec.method == "ngram":
            from specdecode.speculative.ngram import NgramProposer
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif spec is not None:
            from specdecode.speculative.draft_model import DraftModelProposer
            from specdecode.speculative.draft_vocab import draft_head_ids
            draft_path = resolve_model(None if spec.model == "default" else spec.model, "draft")
            draft = load_model(draft_path, c.dtype, c.device, self.max_model_len, c.draft_quantization())
            check_draft_compatible(self.tokenizer, load_tokenizer(draft_path, draft.is_gguf),
                                   target.model.param_count(), draft.model.param_count(),
                                   target.model.args.vocab_size, draft.model.args.vocab_size)
            self.draft_path = draft_path
            keep = draft_head_ids(spec, self.tokenizer, self.eos_token_ids, draft.model.args.vocab_size)
            self.proposer = DraftModelProposer(ModelRunner(draft, c.max_num_seqs, self.max_model_len, c.device),
                                               target.model.args.vocab_size, spec.draft_p_min, keep,
                                               spec.draft_confidence)
        if c.compile:
            for runner in (self.target, getattr(self.proposer, "runner", None)):
                if runner is not None:
                    runner.model.compile_decode()
        self.load_time = time.perf_counter() - t0
        self.scheduler = Scheduler(c.max_num_seqs, c.max_waiting_requests)
        self.spec_stats = SpecDecodeStats()
        self.costs = CostModel()
        if spec is not None and spec.adaptive:
            self.costs = self.calibrate_costs()
        self._parents: dict[str, list[Request]] = {}
        self._counter = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def calibrate_costs(self) -> CostModel:
        """Time target passes and draft steps for adaptive k (a few seconds on a CPU). Only while no
        request is running: it uses cache slot 0 as scratch."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("calibrate_costs() needs an idle engine: it uses a cache slot as scratch.")
        spec = self.config.speculative
        t0 = time.perf_counter()
        costs = calibrate(self.target, getattr(self.proposer, "runner", None),
                          spec.max_k if spec is not None else 1, self.max_model_len)
        logger.info("Calibrated adaptive speculation costs in %.1f s", time.perf_counter() - t0)
        return costs

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """More characters than any prompt of max_model_len tokens can have (twice the longest vocabulary
        entry per token, which also covers normalizers that shorten text)."""
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        return 2 * self.max_model_len * max(longest, 1)

    @functools.cached_property
    def grammar_compiler(self):
        """Compiles structured-output constraints for this tokenizer (built at the first constrained request)."""
        from specdecode.structured.grammar import GrammarCompiler
        return GrammarCompiler(self.tokenizer, self.target.vocab_size, sorted(self.eos_token_ids))

    @classmethod
    def from_kwargs(cls, **kw) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(**kw))

    # ---- requests ----
    def encode_prompt(self, prompt: str | list[int] | None, prompt_token_ids: list[int] | None = None) -> list[int]:
        if prompt_token_ids is None and isinstance(prompt, list):
            prompt_token_ids, prompt = prompt, None
        if prompt_token_ids is not None:
            ids = [int(t) for t in prompt_token_ids]
            vocab = self.target.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise ValueError(f"prompt token ids must be in [0, {vocab}).")
        else:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}.")
            check_text(prompt, "prompt")
            if len(prompt) > self.max_prompt_chars:
                # Checked before tokenizing: no token is longer than the vocabulary's longest entry, so such a
                # prompt cannot fit, and tokenizing megabytes only to say so would stall its caller.
                raise ValueError(f"The prompt has {len(prompt)} characters, more than {self.max_model_len} tokens "
                                 f"(max_model_len) can hold; shorten the prompt or raise max_model_len.")
            ids = self.tokenizer.encode(prompt)
        if not ids:
            bos = getattr(self.tokenizer, "bos_token_id", None)
            if bos is None:
                raise ValueError("The prompt is empty and the tokenizer has no BOS token to start from.")
            ids = [bos]
        if len(ids) >= self.max_model_len:
            raise ValueError(f"The prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                             "shorten the prompt or raise max_model_len.")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self._parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        ids = self.encode_prompt(prompt, prompt_token_ids)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        text = prompt if isinstance(prompt, str) else None
        children = []
        for i in range(params.n):
            p = params if params.n == 1 or params.seed is None else params.clone(seed=(params.seed + i) % 2 ** 64)
            children.append(Request(request_id, text, ids, p, self.tokenizer, max_tokens, self.target.device, i))
        if params.structured_outputs is not None:  # compiled before queueing: a bad constraint is the caller's error
            for child in children:
                child.matcher = self.grammar_compiler.matcher(params.structured_outputs)
        self.scheduler.add(children)
        self._parents[request_id] = children
        self.num_prompt_tokens += len(ids) * params.n

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        touched: dict[str, None] = {}
        for r in self.scheduler.take_aborted(lambda r: r.request_id):
            r.metrics.finished_time = time.time()
            touched[r.request_id] = None
        new = self.scheduler.admit()
        for r in new:
            self._isolated(lambda rs: self._prefill(rs[0]), [r])
            touched[r.request_id] = None
        decode = [r for r in self.scheduler.running if r not in new and not r.finished]
        if decode:
            self._isolated(self._decode, decode)
            for r in decode:
                touched[r.request_id] = None
        for r in [r for r in self.scheduler.running if r.finished]:
            self.scheduler.release(r)
        return [self._output(rid) for rid in touched]

    def _isolated(self, run, reqs: list[Request]) -> None:
        """run(reqs), such that a request whose own numbers break the step fails alone.

        If the batch raises, every request it did not commit yet is run again on its own, from the same
        state: its KV lengths and its seeded generator are put back as they were. Rows are computed
        independently of what shares their pass, so the others' results are exactly what the batch would
        have given."""
        states = {id(r): r.generator.get_state() for r in reqs if r.generator is not None}
        lengths = {id(r): len(r.all_token_ids) for r in reqs}
        cached = {id(r): (r.num_computed, r.draft_computed) for r in reqs}
        try:
            run(reqs)
            return
        except Exception as e:  # noqa: BLE001 - a lone request is to blame; a batch is split below
            if len(reqs) == 1:
                self._fail(reqs[0], e)
                return
        for r in reqs:
            if r.finished or len(r.all_token_ids) != lengths[id(r)]:
                continue  # committed before the failure: its step is done
            if id(r) in states:
                r.generator.set_state(states[id(r)])
            # KV written by the failed attempt lies past these lengths: a length change is the whole rollback
            r.num_computed, r.draft_computed = cached[id(r)]
            self._isolated(run, [r])

    def _fail(self, r: Request, error: Exception) -> None:
        logger.warning("Request %s failed alone: %s: %s", r.request_id, type(error).__name__, error)
        r.status, r.finish_reason = Status.FINISHED, "error"
        r.error = f"{type(error).__name__}: {error}"
        r.metrics.finished_time = time.time()

    def _output(self, rid: str) -> RequestOutput:
        children = self._parents[rid]
        out = children[0].to_output()
        if len(children) > 1:
            out.outputs = [c.completion() for c in children]
            out.finished = all(c.finished for c in children)
            out.error = next((c.error for c in children if c.error), None)
        if out.finished:
            del self._parents[rid]
        return out

    def _prefill(self, r: Request) -> None:
        logits = self.target.prefill(r.slot, r.all_token_ids)
        r.num_computed = len(r.all_token_ids)
        result = rejection_sample(self._target_probs([r], [logits[None]], [[]]),
                                  torch.zeros(1, 0, dtype=torch.long, device=logits.device), [0], None,
                                  [r.params.greedy], [r.generator])
        r.metrics.first_token_time = time.time()
        self._commit(r, result.tokens[0], logits[None])

    def _spec_budget(self, r: Request, n_running: int, k: int) -> int:
        """The most tokens r may draft this step: k, clamped to the tokens left."""
        spec = self.config.speculative
        if self.proposer is None or (spec.disable_by_batch_size and n_running >= spec.disable_by_batch_size):
            return 0
        left = min(r.max_tokens - r.num_output_tokens - 1, self.max_model_len - len(r.all_token_ids))
        return max(0, min(k, left))

    def _choose_k(self, r: Request, cap: int, lookup: bool) -> int:
        """k for r's drafts of one kind (looked up in the context, or from the draft model): the cap, or with
        adaptive speculation the best k for that kind's own acceptance."""
        if not (cap and self.config.speculative.adaptive):
            return cap
        return next_k(cap, r.lookup_acceptance if lookup else r.acceptance, self.costs, lookup,
                      len(r.all_token_ids))

    def _propose(self, reqs: list[Request], n_running: int) -> StepDrafts:
        """This step's drafts, and where each one came from (see StepDrafts)."""
        spec = self.config.speculative
        none = [None] * len(reqs)
        nothing = StepDrafts(Proposal([[] for _ in reqs]), [False] * len(reqs), [[] for _ in reqs], none)
        if spec is None:
            return nothing
        caps = [self._spec_budget(r, n_running, spec.num_speculative_tokens) for r in reqs]
        lookup_caps = [self._spec_budget(r, n_running, spec.lookup_k) for r in reqs] if spec.ngram_first else caps
        if not any(caps) and not any(lookup_caps):
            return nothing
        if spec.method == "ngram":
            ks = [self._choose_k(r, cap, lookup=True) for r, cap in zip(reqs, caps)]
            return StepDrafts(self.proposer.propose(reqs, ks), [True] * len(reqs), [[] for _ in reqs], none)
        ks = [self._choose_k(r, cap, lookup=False) for r, cap in zip(reqs, caps)]
        # With a confidence threshold the draft's own probabilities decide how deep it goes: adaptive k only
        # decides whether the draft model runs at all (and is what a lookup is compared with below).
        depths = [cap if k else 0 for k, cap in zip(ks, caps)] if spec.draft_confidence else ks
        if not spec.ngram_first:
            return StepDrafts(self.proposer.propose(reqs, depths), [False] * len(reqs), [[] for _ in reqs], none)
        found = [ngram_lookup(r.all_token_ids, cap, spec.prompt_lookup_min, spec.prompt_lookup_max) if cap else []
                 for r, cap in zip(reqs, lookup_caps)]
        use = []
        for r, cap, k, f in zip(reqs, lookup_caps, ks, found):
            kl = self._choose_k(r, cap, lookup=True) if f else 0
            if kl and k and spec.adaptive and (
                    self.costs.expected_rate(r.lookup_acceptance, min(kl, len(f)), True, len(r.all_token_ids))
                    < self.costs.expected_rate(r.acceptance, k, False, len(r.all_token_ids))):
                kl = 0  # the draft model is expected to do better here than a copy from the context
            use.append(f[:kl])
        copied_from: list[int | None] = list(none)
        depth: dict[int, int] = {}  # request -> lookup depth, fixed for the step: one estimate per request

        def extend(i: int, drafted: list[int]) -> list[int]:
            # The draft model's latest token may complete an n-gram seen earlier in the context: the model is
            # starting to copy, and the rest of the span costs no draft passes (one-hot drafts, like a lookup).
            r = reqs[i]
            if lookup_caps[i] <= len(drafted):
                return []
            if i not in depth:
                depth[i] = self._lookup_depth(r, lookup_caps[i])
            room = min(lookup_caps[i] - len(drafted), depth[i])
            if room <= 0:
                return []
            copied = ngram_lookup(r.all_token_ids + drafted, room, spec.prompt_lookup_min, spec.prompt_lookup_max)
            if copied:
                copied_from[i] = len(drafted)
            return copied

        prop = self.proposer.propose(reqs, [0 if u else d for u, d in zip(use, depths)], lookups=use, extend=extend)
        return StepDrafts(prop, [bool(u) for u in use], found, copied_from)

    def _lookup_depth(self, r: Request, cap: int) -> int:
        """How deep a lookup may draft for r without touching its probing state: the cap, or with adaptive
        speculation the best k for the lookups' own acceptance (0 while they do not pay)."""
        if not self.config.speculative.adaptive:
            return cap
        return choose_k(*r.lookup_acceptance.rates(self.costs.lookup_prior), cap, self.costs, True,
                        len(r.all_token_ids))

    def _observe(self, r: Request, drafted: list[int], accepted: int, looked_up: bool, found: list[int],
                 emitted: list[int], copied_from: int | None) -> None:
        """Teach adaptive k what this step showed about each draft kind of r."""
        if copied_from is not None:
            # The draft model's tokens, then a copy they opened: each part counts for its own kind; the copy
            # was only tried if every draft-model token before it was accepted.
            self.costs.observe_acceptance(r.acceptance, copied_from, min(accepted, copied_from))
            if accepted >= copied_from:
                self.costs.observe_acceptance(r.lookup_acceptance, len(drafted) - copied_from,
                                              accepted - copied_from, lookup=True)
            else:
                r.lookup_acceptance.observe(0, 0)
            return
        used, other = (r.lookup_acceptance, r.acceptance) if looked_up else (r.acceptance, r.lookup_acceptance)
        self.costs.observe_acceptance(used, len(drafted), accepted, lookup=looked_up)
        if found and not looked_up:
            # An unused lookup is scored against the tokens the target emitted. For a one-hot draft that is
            # exactly the acceptance test (greedy: the same argmax; sampled: accepted with probability p(token),
            # the chance the sample equals it), cut at the emitted length, beyond which nothing is known.
            n = min(len(found), len(emitted))
            match = next((j for j in range(n) if found[j] != emitted[j]), n)
            self.costs.observe_acceptance(other, n, match, lookup=True)
        else:
            other.observe(0, 0)  # this kind did not draft: a step without drafts ends its run

    def _decode(self, reqs: list[Request]) -> None:
        step = self._propose(reqs, len(reqs))
        if any(matcher_of(r) is not None for r in reqs):  # structured outputs: grammar-checked and forced drafts
            budgets = [max(0, min(r.max_tokens - r.num_output_tokens - 1, self.max_model_len - len(r.all_token_ids)))
                       for r in reqs]
            step.proposal = constrain_proposal(reqs, step.proposal, budgets, self.proposer)
        drafts, draft_probs = step.proposal.tokens, step.proposal.probs
        seqs = [(r.slot, r.num_computed, [r.all_token_ids[-1]] + d) for r, d in zip(reqs, drafts)]
        logits = self.target.forward_rows(seqs, all_logits=True)
        kmax = max(len(d) for d in drafts)
        dt = torch.zeros(len(reqs), kmax, dtype=torch.long)
        for i, d in enumerate(drafts):
            dt[i, :len(d)] = torch.tensor(d, dtype=torch.long)
        target_probs = self._target_probs(reqs, logits, drafts)
        if draft_probs is not None and draft_probs.shape[1] > kmax:
            draft_probs = draft_probs[:, :kmax]
        result = rejection_sample(target_probs, dt.to(target_probs.device), [len(d) for d in drafts], draft_probs,
                                  [r.params.greedy for r in reqs], [r.generator for r in reqs])
        for i, r in enumerate(reqs):
            a = result.num_accepted[i]
            r.num_computed = len(r.all_token_ids) + a  # rejected drafts' KV stays in place, just past the length
            if self.proposer is not None:
                self.proposer.rollback(r, len(r.all_token_ids) + a)
            self._observe(r, drafts[i], a, step.looked_up[i], step.found[i], result.tokens[i], step.copied_from[i])
            if drafts[i]:
                r.metrics.spec_decode.record(len(drafts[i]), a)
                self.spec_stats.record(len(drafts[i]), a)
            self._commit(r, result.tokens[i], logits[i])

    def _target_probs(self, reqs: list[Request], logits: list[torch.Tensor],
                      drafts: list[list[int]]) -> torch.Tensor:
        """[R, K+1, V] target distributions; row j of request i assumes drafts[i][:j] were accepted."""
        kmax = max(len(d) for d in drafts)
        V = logits[0].shape[-1]
        out = torch.zeros(len(reqs), kmax + 1, V, device=logits[0].device)
        for i, (r, lg, d) in enumerate(zip(reqs, logits, drafts)):
            rows = lg[:len(d) + 1]
            if r.params.has_penalties:
                hist = r.output_token_ids
                rows = apply_penalties(rows, [r.params] * len(rows), [hist + d[:j] for j in range(len(rows))])
            rows = mask_rows(r, rows, d)  # structured outputs: row j masked by the grammar after d[:j]
            out[i, :len(rows)] = logits_to_probs(rows, [r.params] * len(rows))
        return out

    def _commit(self, r: Request, tokens: list[int], logits: torch.Tensor) -> None:
        """Append emitted tokens one by one, stopping exactly where plain decoding would stop."""
        p = r.params
        for j, t in enumerate(tokens):
            r.all_token_ids.append(t)
            self.num_generation_tokens += 1
            if r.logprobs is not None:
                lp = logprobs_of(logits[j], t, p.logprobs)
                r.logprobs.append(lp)
                r.cumulative_logprob += lp[t]
            r.detok.add(t)
            grammar_done = commit_token(r, t)  # structured outputs: the grammar follows committed tokens only
            if self._check_stop(r, t) or grammar_done:
                r.finish_reason = r.finish_reason or "stop"
                r.status = Status.FINISHED
                r.metrics.finished_time = time.time()
                return

    def _check_stop(self, r: Request, t: int) -> bool:
        p, full = r.params, r.detok.text
        if p.stop:
            # Only the tail can contain a new match: the previous text was already checked.
            lo = max(0, len(r.text) - max(len(s) for s in p.stop))
            hits = [(full.find(s, lo), s) for s in p.stop if full.find(s, lo) >= 0]
            if hits:
                idx, s = min(hits)
                r.text = full[:idx + len(s)] if p.include_stop_str_in_output else full[:idx]
                r.finish_reason, r.stop_reason = "stop", s
                return True
        r.text = full
        if not p.ignore_eos and t in self.eos_token_ids:
            r.finish_reason = "stop"
            return True
        if t in p.stop_token_ids:
            r.finish_reason, r.stop_reason = "stop", t
            return True
        if r.num_output_tokens >= r.max_tokens or len(r.all_token_ids) >= self.max_model_len:
            r.finish_reason = "length"
            return True
        return False
