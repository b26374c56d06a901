"""The engine step: schedule, propose drafts, verify them in one target pass, rejection-sample, commit,
observe; then the step's prompt chunks, in that same pass where that is exact, else in a pass of their own.
Scheduling (slots, blocks, chunks, preemption) is the scheduler's; checking and encoding a request's inputs
is the input processor's."""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import torch

from specdecode import startup
from specdecode.config import EngineConfig, SpeculativeConfig, check_draft_compatible
from specdecode.engine.block_pool import BLOCK_SIZE, BlockPool
from specdecode.engine.input_processor import InputProcessor
from specdecode.engine.kv_cache import KVCache
from specdecode.engine.model_runner import ModelRunner
from specdecode.engine.request import Request, Status
from specdecode.engine.scheduler import QueueFullError, Scheduler
from specdecode.layers.sampler import logits_to_probs, logprobs_of, request_logits
from specdecode.models import huge_pages
from specdecode.models.loader import check_context, load_model
from specdecode.outputs import RequestOutput
from specdecode.sampling_params import SamplingParams
from specdecode.speculative import build_proposer, uses_draft_model
from specdecode.speculative.metrics import SpecDecodeStats
from specdecode.speculative.proposer import Proposal, Proposer
from specdecode.speculative.rejection_sampler import rejection_sample
from specdecode.structured.speculation import (commit_token, constrain_proposal, forced_drafts, learn_spelling,
                                                mask_rows, matcher_of)
from specdecode.tokenizer import eos_ids, load_tokenizer, same_tokenizer_files

logger = logging.getLogger("specdecode")

__all__ = ["LLMEngine", "QueueFullError"]

# Without a kv_cache_memory budget, positions per slot the prefix cache may keep resident (the pool itself has
# room for every slot at max_model_len, as address space): the RAM the 4096-token default context took.
RESIDENT_CONTEXT = 4096


def _ram_bytes() -> int:
    """The machine's physical memory (a large number where the platform does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 50


@dataclass
class PrefillChunks:
    """Prompt chunks for one pass: tokens per request, from the position it has computed up to; after the pass,
    each chunk's logits (every row's [n, V] for a request that wants its prompt's logprobs, else the last
    row's [1, V])."""
    sizes: dict[Request, int]
    starts: dict[Request, int] = field(init=False)
    logits: dict[Request, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.starts = {r: r.num_computed for r in self.sizes}

    def seqs(self) -> list[tuple[int, int, list[int]]]:
        """(slot, start position, tokens) of each chunk, as the runners take them."""
        return [(r.slot, s, r.all_token_ids[s:s + self.sizes[r]]) for r, s in self.starts.items()]

    def every_row(self) -> list[bool]:
        return [r.needs_prompt_logprobs for r in self.sizes]


@dataclass
class VerifyPass:
    """What a step's verification pass leaves for the prefill after it."""
    rows: int = 0  # its rows (after a failed batch, those of the last request verified alone)
    joined: PrefillChunks | None = None  # the prompt chunks it computed too


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from specdecode.models.resolve import resolve_model

        self.config = c = config
        if c.num_threads:
            torch.set_num_threads(c.num_threads)
        torch.manual_seed(c.seed)
        t0 = time.perf_counter()
        target_path = resolve_model(c.model, "target")
        # One after the other: the tokenizers library holds the GIL while it parses, so a parse in a thread
        # only stalls the weights' loading (which was slower overlapped than after it).
        target = load_model(target_path, c.dtype, c.device, c.max_model_len, c.quantization)
        check_context(target.model.args, target.max_model_len)
        self.tokenizer = load_tokenizer(target_path, target_path.is_file())
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)
        self.max_model_len = target.max_model_len
        self.eos_token_ids = eos_ids(self.tokenizer, target.hf_config)
        self.model_path = target_path
        self.proposer: Proposer | None = None
        self.draft_runner: ModelRunner | None = None  # the draft model's, when a speculative method uses one
        self.draft_path = None
        spec = c.speculative
        draft = None
        if uses_draft_model(spec):
            draft_path = resolve_model(None if spec.model == "default" else spec.model, "draft")
            draft = load_model(draft_path, c.dtype, c.device, self.max_model_len, c.draft_quantization())
            same = same_tokenizer_files(target_path, target.is_gguf, draft_path, draft.is_gguf)
            check_draft_compatible(self.tokenizer, None if same else load_tokenizer(draft_path, draft.is_gguf),
                                   target.model.param_count(), draft.model.param_count(),
                                   target.model.args.vocab_size, draft.model.args.vocab_size,
                                   str(target_path), str(draft_path))
            self.draft_path = draft_path
        # One pool of KV blocks for the target's cache and the draft's, sized by the KV memory budget.
        self.pool = self._block_pool([m.model for m in (target, draft) if m is not None])
        self.target = ModelRunner(target, c.max_num_seqs, self.max_model_len, c.device, c.kv_cache_dtype, self.pool)
        if draft is not None:
            self.draft_runner = ModelRunner(draft, c.max_num_seqs, self.max_model_len, c.device, c.kv_cache_dtype,
                                            self.pool, draft=True)
        if c.compile:
            for runner in (self.target, self.draft_runner):
                if runner is not None:
                    runner.model.compile_decode()
        self.load_time = time.perf_counter() - t0
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, self.target.vocab_size,
                                              self.eos_token_ids, lambda: (self.proposer, self.config.speculative))
        self.scheduler = Scheduler(c.max_num_seqs, c.max_waiting_requests, self.pool, self.target, self.max_model_len,
                                   c.max_num_batched_tokens, draft=self.draft_runner)
        self.spec_stats = SpecDecodeStats()
        self._proposers: dict[str, Proposer | None] = {}  # by config: switching back resumes what it learned
        self._shared: dict = {}  # what proposers over the one draft model share (truncated heads)
        self._timing = False  # calibrate_costs is timing passes
        self.set_speculative(spec)
        self._parents: dict[str, list[Request]] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        huge_pages.start(self._quiet)  # weights onto huge pages while no engine here runs or times anything
        startup.resume()  # a command's start-up is over (startup.py); elsewhere a no-op

    def _quiet(self) -> bool:
        """No request to run and no pass being timed: background work (huge_pages) may use the machine."""
        return not self._timing and not self.scheduler.has_unfinished()

    def _block_pool(self, models: list) -> BlockPool:
        """The KV blocks: kv_cache_memory GiB of them (target and draft together), or by default enough for
        every slot to hold max_model_len positions. Too small for one max_model_len sequence is an error.
        By default the storage is only address space (engine.kv_cache), and what the prefix cache keeps
        written past the running sequences' blocks is bounded by RESIDENT_CONTEXT positions per slot."""
        c = self.config
        per_block = sum(KVCache.block_bytes(m, c.kv_cache_dtype, c.device) for m in models)
        per_seq = -(-self.max_model_len // BLOCK_SIZE)
        resident = None
        if c.kv_cache_memory is None:
            # Address space is free, but the kernel refuses one map much larger than the machine's RAM (a
            # 128k-context model at 8 slots): then fewer blocks, never fewer than one full sequence's.
            num_blocks = max(per_seq, min(c.max_num_seqs * per_seq, _ram_bytes() // per_block))
            resident = max(per_seq, c.max_num_seqs * min(per_seq, RESIDENT_CONTEXT // BLOCK_SIZE))
        else:
            num_blocks = int(c.kv_cache_memory * 2 ** 30 // per_block)
            if num_blocks < per_seq:
                need = per_seq * per_block / 2 ** 30
                raise ValueError(f"kv_cache_memory={c.kv_cache_memory} GiB cannot hold one sequence of "
                                 f"max_model_len={self.max_model_len} tokens ({need:.2f} GiB for these models); "
                                 "raise kv_cache_memory or lower max_model_len.")
        return BlockPool(num_blocks, c.max_num_seqs, per_seq, c.device, c.enable_prefix_caching, resident)

    def set_speculative(self, spec: SpeculativeConfig | dict | None) -> None:
        """Switch speculative decoding on this loaded engine, between requests: a SpeculativeConfig (or a
        dict in vLLM's ``speculative_config`` form), or None for plain decoding. A method with a draft model
        uses the draft this engine loaded. Each config keeps its proposer, so switching back to it resumes
        what it learned (acceptance, cached suffixes), as if it had run alone."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("set_speculative() needs an idle engine: running requests hold proposer state.")
        if isinstance(spec, dict):
            spec = self.config.speculative_for(spec)
        key = repr(spec)
        if key not in self._proposers:
            proposer = build_proposer(spec, self.draft_runner, self.target.vocab_size, self.tokenizer,
                                      self.eos_token_ids, self._shared)
            if proposer is not None and spec.adaptive:
                self.proposer = proposer
                self.calibrate_costs()
            self._proposers[key] = proposer
        self.proposer = self._proposers[key]
        self.config.speculative = spec

    def reset_speculative_state(self) -> None:
        """Forget what every speculative config of this engine has learned (acceptance, answer lengths, suffix
        caches): the next request of each starts as in a freshly loaded engine. The timed pass costs are kept.
        For benchmarks, whose warm-up requests would otherwise teach the policy that answers are short."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("reset_speculative_state() needs an idle engine: running requests hold proposer "
                               "state.")
        self._proposers.clear()
        self.set_speculative(self.config.speculative)

    def calibrate_costs(self, refresh: bool = False):
        """The pass costs adaptive k weighs, for the current proposer: timed once (a few seconds on a CPU)
        and kept in the cache folder per model files, weight formats, CPU, kernel path and threads, so later
        starts take them from there; ``refresh`` times them again. Only while no request is running: timing
        uses cache slot 0 as scratch."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("calibrate_costs() needs an idle engine: it uses a cache slot as scratch.")
        if self.proposer is None:
            raise RuntimeError("calibrate_costs(): this engine has no speculative method to calibrate for.")
        from specdecode.layers import kernels

        c = self.config
        identity = {"target": self.model_path, "draft": self.draft_path, "quantization": c.quantization,
                    "draft_quantization": c.draft_quantization(), "dtype": c.dtype, "device": str(self.target.device),
                    "kv_cache_dtype": getattr(c, "kv_cache_dtype", None), "threads": torch.get_num_threads(),
                    "kernel": (kernels.describe(), kernels.source_digest()) if self.target.device.type == "cpu"
                    else torch.__version__}
        self._timing = True
        try:
            return self.proposer.calibrate(self.target, self.max_model_len, identity, refresh)
        finally:
            self._timing = False
            self.pool.free(0)  # the scratch blocks

    @functools.cached_property
    def grammar_compiler(self):
        """Compiles structured-output constraints for this tokenizer (built at the first constrained request)."""
        from specdecode.structured.grammar import GrammarCompiler
        return GrammarCompiler(self.tokenizer, self.target.vocab_size, sorted(self.eos_token_ids))

    @classmethod
    def from_kwargs(cls, **kw) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(**kw))

    # ---- requests ----
    def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, prediction_token_ids: list[int] | None = None) -> None:
        """``prediction_token_ids``: params.prediction already tokenized (``InputProcessor.encode_prediction``),
        as the async engine does off the engine thread; by default it is tokenized here."""
        params = params or SamplingParams()
        if request_id in self._parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        inp = self.input_processor.process(prompt, params, prompt_token_ids, prediction_token_ids)
        ids = inp.prompt_token_ids
        text = prompt if isinstance(prompt, str) else None
        children = []
        for i in range(params.n):
            p = params if params.n == 1 or params.seed is None else params.clone(seed=(params.seed + i) % 2 ** 64)
            children.append(Request(request_id, text, ids, p, self.tokenizer, inp.max_tokens, i))
            children[-1].prediction_ids = inp.prediction_ids
            children[-1].bad_words_ids = inp.bad_words_ids
        if params.structured_outputs is not None:  # compiled before queueing: a bad constraint is the caller's error
            for child in children:
                child.matcher = self.grammar_compiler.matcher(params.structured_outputs)
        self.scheduler.add(children)
        self._parents[request_id] = children
        self.num_prompt_tokens += len(ids) * params.n

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix; False (and nothing done) while requests are running."""
        if self.scheduler.has_unfinished():
            return False
        self.pool.reset_prefix_cache()
        return True

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        """Decode every running request by one verification pass, and prefill waiting prompts with what is
        left of the step's token budget (max_num_batched_tokens), so running streams keep going while a long
        prompt is prefilled chunk by chunk. Where prompt rows take the decode rows' path, the prompt chunks
        ride in the verification pass; elsewhere they get a pass of their own after it."""
        plan = self.scheduler.schedule(self.proposer.max_k if self.proposer is not None else 0)
        touched = dict.fromkeys(r.request_id for r in plan.aborted)
        verify = VerifyPass()
        if plan.decode:
            # The whole batch's pass also carries the step's prompt chunks; a request run alone after a failure
            # does not.
            self._isolated(lambda rs: self._decode(rs, verify, join=rs is plan.decode), plan.decode)
            touched.update(dict.fromkeys(r.request_id for r in plan.decode))
        joined = verify.joined
        if joined is not None:  # computed in the verification pass: only their first tokens are left
            self._isolated(lambda rs: self._prefilled(rs, joined), list(joined.sizes))
            sizes = joined.sizes
        else:
            sizes = self.scheduler.schedule_prefill(verify.rows)
            if sizes:
                self._isolated(lambda rs: self._prefill(rs, sizes), list(sizes))
        touched.update(dict.fromkeys(r.request_id for r in sizes))
        self.scheduler.free_finished()
        return [self._output(rid) for rid in touched]

    def _decode(self, reqs: list[Request], verify: VerifyPass, join: bool) -> None:
        """One step of the running requests: propose, verify in one target pass, rejection-sample, commit,
        observe. With ``join``, the step's prompt chunks ride in the same pass where that is exact
        (``Scheduler.schedule_joined_prefill``); ``verify`` records the pass's rows and those chunks."""
        prop, forced = self._propose(reqs)
        drafts = prop.tokens
        seqs = [(r.slot, r.num_computed, [r.all_token_ids[-1]] + d) for r, d in zip(reqs, drafts)]
        verify.rows = sum(len(toks) for _, _, toks in seqs)
        chunks = PrefillChunks(self.scheduler.schedule_joined_prefill(verify.rows) if join else {})
        logits = self.target.forward_rows(seqs + chunks.seqs(), all_logits=[True] * len(reqs) + chunks.every_row())
        if chunks.sizes:
            chunks.logits = dict(zip(chunks.sizes, logits[len(reqs):]))
            verify.joined = chunks
        result = self._rejection_sample(reqs, logits[:len(reqs)], prop)
        for i, r in enumerate(reqs):
            self._commit_verified(r, drafts[i], forced[i], logits[i], result.num_accepted[i], result.tokens[i])

    def _propose(self, reqs: list[Request]) -> tuple[Proposal, list[list[int]]]:
        """This step's drafts of each request, and the forced drafts they start with. Structured outputs: the
        engine drafts the text the grammar forces, the proposer drafts after it, and its drafts are cut where
        the grammar forbids them."""
        proposer = self.proposer
        budgets = self._budgets(reqs)
        if proposer:
            s = self.scheduler
            proposer.expect_batch(min(len(s.running) + len(s.waiting), self.config.max_num_seqs))
        constrained = any(matcher_of(r) is not None for r in reqs)
        forced = forced_drafts(reqs, budgets) if constrained else [[] for _ in reqs]
        prop = Proposal([[] for _ in reqs])
        if proposer:
            for r, f in zip(reqs, forced):
                r.draft_prefix = f
            try:
                prop = proposer.propose(reqs, [b - len(f) for b, f in zip(budgets, forced)])
            finally:
                for r in reqs:
                    r.draft_prefix = []
        if constrained:
            prop = constrain_proposal(reqs, prop, forced, budgets, proposer,
                                      self.grammar_compiler.text_lookup if proposer else None)
        return prop, forced

    def _commit_verified(self, r: Request, drafts: list[int], forced: list[int], logits: torch.Tensor, a: int,
                         emitted: list[int]) -> None:
        """After the verification pass accepted ``a`` of ``drafts`` (the first of them ``forced``): keep their
        keys and values, count them, commit ``emitted`` and let the proposer observe the step."""
        proposer = self.proposer
        r.num_computed = len(r.all_token_ids) + a  # rejected drafts' KV stays in place, just past the length
        if drafts:
            r.metrics.spec_decode.record(len(drafts), a)
            self.spec_stats.record(len(drafts), a)
        f = len(forced)
        if proposer is not None:
            proposer.rollback(r, r.num_computed)
            proposer.note_target(r, logits[f if a >= f else 0])  # where the proposer's drafts began
        self._commit(r, emitted, logits, self._origins(r, drafts, f, a))
        r.num_forced += min(a, f)
        if a < f:
            learn_spelling(r, forced, a, emitted)
        if proposer is not None and a >= f:
            # The proposer learns from its own drafts only; where forced text was rejected, they went untested.
            # Text-lookup drafts are the engine's, not the proposer's: for it, this step drafted nothing.
            own, ok = ([], 0) if r.text_drafted else (drafts[f:], a - f)
            proposer.observe(r, own, ok, emitted[f:])

    def _origins(self, r: Request, drafts: list[int], f: int, a: int) -> list[str]:
        """Where each token a step emits came from (outputs.TokenOrigin): its ``a`` accepted drafts (the first
        ``f`` of them forced by the grammar), then the target's own token."""
        own = a - min(a, f)
        if not own:
            source = []
        elif r.text_drafted or self.proposer is None:
            source = ["lookup"] * own
        else:
            source = self.proposer.draft_origins(r, own)
        last = "target" if not drafts else "bonus" if a == len(drafts) else "corrected"
        return ["grammar"] * min(a, f) + source + [last]

    def _prefill(self, reqs: list[Request], sizes: dict[Request, int]) -> None:
        """Prefill the next ``sizes[r]`` prompt tokens of each request in one target pass; at a prompt's end,
        sample its first output token."""
        chunks = PrefillChunks({r: sizes[r] for r in reqs})
        every_row = chunks.every_row()
        logits = self.target.prefill_many(chunks.seqs(), every_row)
        chunks.logits = {r: lg if e else lg[None] for r, lg, e in zip(reqs, logits, every_row)}
        self._prefilled(reqs, chunks)

    def _prefilled(self, reqs: list[Request], chunks: PrefillChunks) -> None:
        """After a pass computed each request's chunk: advance, register the blocks, note prompt logprobs, and
        at a prompt's end sample its first output token."""
        for r in reqs:
            start, lg = chunks.starts[r], chunks.logits[r]
            if r.needs_prompt_logprobs:
                self._note_prompt_logprobs(r, start, lg)
            lg = lg[-1]
            r.num_computed = start + chunks.sizes[r]
            self.pool.register(r.slot, r.all_token_ids, r.num_computed, r.draft_computed)
            if r.prefilling or r.resumed:
                continue
            result = rejection_sample(self._target_probs([r], [lg[None]], [[]]), [[]], [0], None, [r.argmax_rows])
            r.metrics.first_token_time = time.time()
            if self.proposer is not None:
                self.proposer.note_target(r, lg)
                self.proposer.prefill(r)
            self._commit(r, result.tokens[0], lg[None], ["target"])

    def _note_prompt_logprobs(self, r: Request, start: int, rows: torch.Tensor) -> None:
        """Prompt logprobs from a chunk's rows: row i (position start + i) gives the logprob of the prompt token
        at start + i + 1. Positions already noted (a preempted request prefills again) are skipped."""
        have, end = len(r.prompt_logprobs), len(r.prompt_token_ids)
        lo, hi = have - 1 - start, min(len(rows), end - 1 - start)
        if lo < 0:
            raise RuntimeError(f"prompt logprobs of {r.request_id}: positions {have}..{start} were never computed")
        if hi > lo:
            r.prompt_logprobs += logprobs_of(rows[lo:hi], r.all_token_ids[start + lo + 1:start + hi + 1],
                                             r.params.prompt_logprobs, self.token_text)

    def _budgets(self, reqs: list[Request]) -> list[int]:
        """The most tokens each request may draft this step: what it may still emit, less the target's own
        token (0 for all while the batch is at disable_by_batch_size)."""
        spec = self.config.speculative
        if spec is not None and spec.disable_by_batch_size and len(reqs) >= spec.disable_by_batch_size:
            return [0] * len(reqs)
        return [max(0, min(r.max_tokens - r.num_output_tokens - 1, self.max_model_len - len(r.all_token_ids)))
                if r.params.speculative_decoding else 0 for r in reqs]

    def _rejection_sample(self, reqs: list[Request], logits: list[torch.Tensor], prop: Proposal):
        drafts, draft_probs = prop.tokens, prop.probs
        return rejection_sample(self._target_probs(reqs, logits, drafts), drafts, [len(d) for d in drafts],
                                draft_probs, [r.argmax_rows for r in reqs])

    def _target_probs(self, reqs: list[Request], logits: list[torch.Tensor],
                      drafts: list[list[int]]) -> list[torch.Tensor]:
        """Per request, its [len(drafts) + 1, V] target distributions; row j assumes drafts[i][:j] were accepted.
        A greedy request's rows are its processed logits: the rejection sampler only takes their argmax, which
        is that of the one-hot distribution, and a one-hot over the vocabulary per row cost several passes over
        it. A seeded request's rows are its probabilities over each position's noise (``PositionNoise``): its
        token there is their argmax too."""
        processed = []
        for r, lg, d in zip(reqs, logits, drafts):
            # Row j follows the output and d[:j]: logit_bias, min_tokens and penalties per row, then the grammar's
            # mask (structured outputs: the grammar state after d[:j]).
            grammar = (lambda x, r=r, d=d: mask_rows(r, x, d)) if matcher_of(r) is not None else None
            rows = request_logits(lg[:len(d) + 1], r.params, r.output_token_ids, d, self.eos_token_ids, grammar,
                                  r.bad_words_ids)
            if r.params.greedy:
                processed.append(rows.float())
                continue
            probs = logits_to_probs(rows, [r.params] * len(rows))
            if r.noise is not None:
                r.noise.forget_before(r.num_output_tokens)
                probs = r.noise.scores(probs, r.num_output_tokens)
            processed.append(probs)
        return processed

    def _commit(self, r: Request, tokens: list[int], logits: torch.Tensor, origins: list[str]) -> None:
        """Append emitted tokens one by one, stopping exactly where plain decoding would stop; ``origins``:
        where each came from."""
        lps = (logprobs_of(logits[:len(tokens)], tokens, r.params.logprobs, self.token_text)
               if r.logprobs is not None else None)
        for j, t in enumerate(tokens):
            r.all_token_ids.append(t)
            self.num_generation_tokens += 1
            if lps is not None:
                r.logprobs.append(lps[j])
                r.cumulative_logprob += lps[j][t].logprob
            r.detok.add(t)
            r.token_origins.append(origins[j])
            r.token_text_ends.append(len(r.detok.text))
            grammar_done = commit_token(r, t)  # structured outputs: the grammar follows committed tokens only
            if self._check_stop(r, t) or grammar_done:
                r.finish_reason = r.finish_reason or "stop"
                r.status = Status.FINISHED
                r.metrics.finished_time = time.time()
                if self.proposer is not None:
                    self.proposer.finish(r)
                return

    def _token_text(self, token_id: int) -> str:
        """One token's text on its own (a Logprob's decoded_token; ``token_text`` caches it)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _check_stop(self, r: Request, t: int) -> bool:
        p, full = r.params, r.detok.text
        # min_tokens (vLLM): until then only the length ends a request; stop strings count after it
        early = r.num_output_tokens < p.min_tokens
        if p.stop and r.num_output_tokens > p.min_tokens:
            # A new match ends in the text this token added: the previous text was already checked (or, before
            # min_tokens, did not count).
            found = [(full.find(s, max(0, len(r.text) - len(s) + 1)), s) for s in p.stop]
            hits = [h for h in found if h[0] >= 0]
            if hits:
                idx, s = min(hits)
                r.text = full[:idx + len(s)] if p.include_stop_str_in_output else full[:idx]
                r.finish_reason, r.stop_reason = "stop", s
                return True
        r.text = full
        if not early and not p.ignore_eos and t in self.eos_token_ids:
            r.finish_reason = "stop"
            return True
        if not early and t in p.stop_token_ids:
            r.finish_reason, r.stop_reason = "stop", t
            return True
        if r.num_output_tokens >= r.max_tokens or len(r.all_token_ids) >= self.max_model_len:
            r.finish_reason = "length"
            return True
        return False

    def _isolated(self, run, reqs: list[Request]) -> None:
        """run(reqs), such that a request whose own numbers break the step fails alone.

        If the batch raises, every request it did not commit yet is run again on its own, from the same
        state: its KV lengths are put back as they were (a seeded request's noise is a function of the
        position, so it draws the same again). Rows are computed independently of what shares their pass, so the
        others' results are exactly what the batch would have given."""
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
