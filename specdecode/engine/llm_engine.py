"""The engine step loop: admit; decode the running requests (propose, verify in one target pass,
rejection-sample, commit, observe); prefill new prompts in chunks under the step's token budget."""
from __future__ import annotations

import functools
import logging
import time

import torch

from specdecode import startup
from specdecode.config import EngineConfig, SpeculativeConfig, check_draft_compatible
from specdecode.engine.block_pool import BLOCK_SIZE, BlockPool
from specdecode.engine.kv_cache import KVCache
from specdecode.engine.model_runner import ModelRunner
from specdecode.engine.request import Request, Status
from specdecode.engine.scheduler import QueueFullError, Scheduler
from specdecode.fim import FimTokens, find_fim_tokens, fim_prompt_ids, known_spellings
from specdecode.layers.sampler import logits_to_probs, logprobs_of, request_logits
from specdecode.models import huge_pages
from specdecode.models.loader import check_context, load_model
from specdecode.outputs import RequestOutput
from specdecode.sampling_params import SamplingParams, check_text
from specdecode.speculative import build_proposer, uses_draft_model
from specdecode.speculative.metrics import SpecDecodeStats
from specdecode.speculative.proposer import Proposal, Proposer
from specdecode.speculative.rejection_sampler import rejection_sample
from specdecode.structured.speculation import (commit_token, constrain_proposal, forced_drafts, learn_spelling,
                                                mask_rows, matcher_of)
from specdecode.tokenizer import encode_text, eos_ids, load_tokenizer, same_tokenizer_files

# The most prompt rows one pass computes for a request that wants its prompt's logprobs: each row's logits span
# the vocabulary, so a chunk's are this many rows of it at most.
PROMPT_LOGPROBS_ROWS = 256

logger = logging.getLogger("specdecode")

__all__ = ["LLMEngine", "QueueFullError"]

# Prompt tokens one step may prefill (with the running requests' verification rows) unless
# max_num_batched_tokens says otherwise: chunks this size keep streams moving during a long prefill while
# each chunk still amortises one read of the weights over many tokens.
DEFAULT_BATCHED_TOKENS = 256


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
                                   target.model.args.vocab_size, draft.model.args.vocab_size)
            self.draft_path = draft_path
        # One pool of KV blocks for the target's cache and the draft's, sized by the KV memory budget.
        self.pool = self._block_pool([m.model for m in (target, draft) if m is not None])
        self.target = ModelRunner(target, c.max_num_seqs, self.max_model_len, c.device, c.kv_cache_dtype, self.pool)
        if draft is not None:
            self.draft_runner = ModelRunner(draft, c.max_num_seqs, self.max_model_len, c.device, c.kv_cache_dtype,
                                            self.pool)
        if c.compile:
            for runner in (self.target, self.draft_runner):
                if runner is not None:
                    runner.model.compile_decode()
        self.load_time = time.perf_counter() - t0
        self.scheduler = Scheduler(c.max_num_seqs, c.max_waiting_requests, self.pool)
        self.max_num_batched_tokens = c.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
        self.spec_stats = SpecDecodeStats()
        self._proposers: dict[str, Proposer | None] = {}  # by config: switching back resumes what it learned
        self._shared: dict = {}  # what proposers over the one draft model share (truncated heads)
        self._timing = False  # calibrate_costs is timing passes
        self.set_speculative(spec)
        self._parents: dict[str, list[Request]] = {}
        self._counter = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        huge_pages.start(self._quiet)  # weights onto huge pages while no engine here runs or times anything
        startup.resume()  # a command's start-up is over (startup.py); elsewhere a no-op

    def _quiet(self) -> bool:
        """No request to run and no pass being timed: background work (huge_pages) may use the machine."""
        return not self._timing and not self.scheduler.has_unfinished()

    def _block_pool(self, models: list) -> BlockPool:
        """The KV blocks: kv_cache_memory GiB of them (target and draft together), or by default enough for
        every slot to hold max_model_len positions. Too small for one max_model_len sequence is an error."""
        c = self.config
        per_block = sum(KVCache.block_bytes(m, c.kv_cache_dtype, c.device) for m in models)
        per_seq = -(-self.max_model_len // BLOCK_SIZE)
        if c.kv_cache_memory is None:
            num_blocks = c.max_num_seqs * per_seq
        else:
            num_blocks = int(c.kv_cache_memory * 2 ** 30 // per_block)
            if num_blocks < per_seq:
                need = per_seq * per_block / 2 ** 30
                raise ValueError(f"kv_cache_memory={c.kv_cache_memory} GiB cannot hold one sequence of "
                                 f"max_model_len={self.max_model_len} tokens ({need:.2f} GiB for these models); "
                                 "raise kv_cache_memory or lower max_model_len.")
        return BlockPool(num_blocks, c.max_num_seqs, per_seq, c.device, c.enable_prefix_caching)

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
    def max_prompt_chars(self) -> int:
        """More characters than any prompt of max_model_len tokens can have (twice the longest vocabulary
        entry per token, which also covers normalizers that shorten text)."""
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        return 2 * self.max_model_len * max(longest, 1)

    def _cannot_fit(self, text: str) -> bool:
        """Whether ``text`` has more characters than max_model_len tokens can hold, told without tokenizing it
        (tokenizing megabytes only to say so would stall the caller). The bound is at least 2 * max_model_len,
        and shorter text skips it: finding the vocabulary's longest entry reads the whole vocabulary (a large
        one takes a noticeable moment), which would otherwise delay a first answer."""
        return len(text) > 2 * self.max_model_len and len(text) > self.max_prompt_chars

    @functools.cached_property
    def grammar_compiler(self):
        """Compiles structured-output constraints for this tokenizer (built at the first constrained request)."""
        from specdecode.structured.grammar import GrammarCompiler
        return GrammarCompiler(self.tokenizer, self.target.vocab_size, sorted(self.eos_token_ids))

    @classmethod
    def from_kwargs(cls, **kw) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(**kw))

    # ---- requests ----
    @functools.cached_property
    def fim_tokens(self) -> FimTokens | None:
        """The target's fill-in-the-middle tokens (specdecode.fim), None if its vocabulary has none."""
        return find_fim_tokens(self.tokenizer)

    def encode_prompt(self, prompt: str | list[int] | None, prompt_token_ids: list[int] | None = None,
                      suffix: str | None = None, truncate: int | None = None) -> list[int]:
        """The token ids a prompt feeds the model. With a ``suffix``, the prompt (text or ids) is the prefix of a
        fill-in-the-middle prompt: the model writes what goes between the two. An empty suffix is none (OpenAI's
        completions API reads it so). ``truncate`` (SamplingParams.truncate_prompt_tokens): keep the last
        ``truncate`` ids; -1 keeps as many as leave room for one token to be written."""
        if prompt_token_ids is None and isinstance(prompt, list):
            prompt_token_ids, prompt = prompt, None
        if suffix is not None and not isinstance(suffix, str):
            raise ValueError(f"suffix must be a string, got {type(suffix).__name__}.")
        if truncate is not None:
            if suffix:
                raise ValueError("truncate_prompt_tokens cannot be combined with suffix: cutting the start of a "
                                 "fill-in-the-middle prompt would cut its prefix token.")
            if truncate >= self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens ({truncate}) must be below the context length "
                                 f"({self.max_model_len} tokens), or -1.")
        fim = None
        if suffix:
            fim = self.fim_tokens
            if fim is None:
                raise ValueError("suffix asks to fill in the middle, which needs a code model trained for it: this "
                                 f"model's vocabulary has none of the known tokens for it ({known_spellings()}).")
            check_text(suffix, "suffix")
            if self._cannot_fit(suffix):
                raise ValueError(f"suffix has {len(suffix)} characters, more than {self.max_model_len} tokens "
                                 f"(max_model_len) can hold; shorten it or raise max_model_len.")
        if prompt_token_ids is not None:
            ids = self._checked_ids(prompt_token_ids, "prompt token ids")
        else:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}.")
            check_text(prompt, "prompt")
            if truncate is None and self._cannot_fit(prompt):
                raise ValueError(f"The prompt has {len(prompt)} characters, more than {self.max_model_len} tokens "
                                 f"(max_model_len) can hold; shorten the prompt or raise max_model_len.")
            ids = encode_text(self.tokenizer, prompt) if fim is None else self.tokenizer.encode(
                prompt, add_special_tokens=False)
        if fim is not None:
            ids = fim_prompt_ids(self.tokenizer, fim, ids, suffix)
        if truncate is not None:
            ids = ids[-(self.max_model_len - 1 if truncate == -1 else truncate):]
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
                    prompt_token_ids: list[int] | None = None, prediction_token_ids: list[int] | None = None) -> None:
        """``prediction_token_ids``: params.prediction already tokenized (``encode_prediction``), as the async
        engine does off the engine thread; by default it is tokenized here."""
        params = params or SamplingParams()
        if request_id in self._parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if params.logit_bias and max(params.logit_bias) >= self.target.vocab_size:
            raise ValueError(f"logit_bias names token id {max(params.logit_bias)}, outside the vocabulary "
                             f"(ids 0..{self.target.vocab_size - 1}).")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= self.target.vocab_size:
            raise ValueError(f"allowed_token_ids names token id {max(params.allowed_token_ids)}, outside the "
                             f"vocabulary (ids 0..{self.target.vocab_size - 1}).")
        if params.allowed_token_ids and params.min_tokens > 0:
            held = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            if set(params.allowed_token_ids) <= held:
                raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens holds back: no token "
                                 "could be written before min_tokens.")
        bad_words = self.bad_words_ids(params.bad_words)
        ids = self.encode_prompt(prompt, prompt_token_ids, truncate=params.truncate_prompt_tokens)
        predicted = (self.encode_prediction(params.prediction) if prediction_token_ids is None
                     else self._checked_ids(prediction_token_ids, "prediction token ids"))
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        text = prompt if isinstance(prompt, str) else None
        children = []
        for i in range(params.n):
            p = params if params.n == 1 or params.seed is None else params.clone(seed=(params.seed + i) % 2 ** 64)
            children.append(Request(request_id, text, ids, p, self.tokenizer, max_tokens, i))
            children[-1].prediction_ids = predicted
            children[-1].bad_words_ids = bad_words
        if params.structured_outputs is not None:  # compiled before queueing: a bad constraint is the caller's error
            for child in children:
                child.matcher = self.grammar_compiler.matcher(params.structured_outputs)
        self.scheduler.add(children)
        self._parents[request_id] = children
        self.num_prompt_tokens += len(ids) * params.n

    def bad_words_ids(self, words: list[str] | None) -> list[list[int]]:
        """SamplingParams.bad_words as token sequences: each word as written and after a space (a word starts
        with one inside a text, not at its start), as vLLM tokenizes them."""
        seqs: list[list[int]] = []
        for word in words or ():
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def _checked_ids(self, token_ids: list[int], what: str) -> list[int]:
        ids = [int(t) for t in token_ids]
        vocab = self.target.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"{what} must be in [0, {vocab}).")
        return ids

    def encode_prediction(self, prediction: str | None) -> list[int] | None:
        """The tokens of a request's predicted output (SamplingParams.prediction), which only a speculative
        method that drafts by lookup can use: elsewhere it is refused, not ignored."""
        if not prediction:
            return None
        if self.proposer is None or not self.proposer.drafts_by_lookup:
            method = "off" if self.proposer is None else f"'{self.config.speculative.method}'"
            raise ValueError(f"prediction needs a speculative method that drafts by lookup (the default, ngram or "
                             f"suffix); speculative decoding here is {method}.")
        if self._cannot_fit(prediction):
            raise ValueError(f"The prediction has {len(prediction)} characters, more than {self.max_model_len} "
                             "tokens (max_model_len) can hold; shorten it.")
        return self.tokenizer.encode(prediction, add_special_tokens=False)

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
        touched: dict[str, None] = {}
        for r in self.scheduler.take_aborted(lambda r: r.request_id):
            r.metrics.finished_time = time.time()
            touched[r.request_id] = None
        self.scheduler.admit()
        rows = self._rows = 0
        self._joined = None
        decode = self._make_room([r for r in self.scheduler.running if not r.prefilling and not r.finished])
        if decode:
            # The whole batch's pass also carries the step's prompt chunks (_decode); a request run alone after
            # a failure does not.
            self._isolated(lambda rs: self._decode(rs, join_prompts=rs is decode), decode)
            rows = self._rows
            touched.update((r.request_id, None) for r in decode)
        if self._joined is not None:  # computed in the decode pass: only their first tokens are left
            chunks, starts, logits = self._joined
            self._isolated(lambda rs: self._prefilled(rs, chunks, starts, logits), list(chunks))
        else:
            chunks = self._prefill_chunks(self.max_num_batched_tokens - rows)
            if chunks:
                self._isolated(lambda rs: self._prefill(rs, chunks), list(chunks))
        touched.update((r.request_id, None) for r in chunks)
        for r in [r for r in self.scheduler.running if r.finished]:
            self._release(r)
        return [self._output(rid) for rid in touched]

    def _chunk(self, r: Request, budget: int, first: bool) -> int:
        """How many prompt tokens of ``r`` to prefill now: what the budget allows, ending on a block boundary
        unless it is the prompt's end (so that chunks never change a position's result, see
        layers.attention); at least one block for the first prompt in line, so prefill always progresses."""
        left = r.prefill_end - r.num_computed
        n = min(left, budget)
        if n < left:
            n -= (r.num_computed + n) % BLOCK_SIZE
        if n <= 0 and first:
            n = min(left, BLOCK_SIZE - r.num_computed % BLOCK_SIZE)
        return max(n, 0)

    def _prefill_chunks(self, budget: int, preempt: bool = True) -> dict[Request, int]:
        """The prompt chunks this step prefills (in one pass), oldest request first, within ``budget`` tokens.
        A request whose next block another chunk of this step computes from the same tokens waits a step: it
        then finds that block in the prefix cache instead of computing it twice (a shared system prompt).
        Without ``preempt``, chunks stop where blocks would have to be taken from a running request."""
        chunks: dict[Request, int] = {}
        for r in [r for r in self.scheduler.running if r.prefilling and not r.finished]:
            if r.status is not Status.RUNNING:
                continue  # preempted by an older request's chunk
            self._use_prefix_cache(r)
            every_row = r.needs_prompt_logprobs
            if chunks and not every_row and self._computed_by(chunks, r):
                continue
            n = self._chunk(r, min(budget, PROMPT_LOGPROBS_ROWS) if every_row else budget, not chunks)
            if n == 0 or not self._reserve(r, r.num_computed + n, preempt):
                break
            chunks[r] = n
            budget -= n
        return chunks

    @staticmethod
    def _computed_by(chunks: dict[Request, int], r: Request) -> bool:
        """Whether one of ``chunks`` computes r's next block, from the same tokens before and in it."""
        start = r.num_computed
        end = min(start + BLOCK_SIZE, r.prefill_end)
        if end - start < BLOCK_SIZE:
            return False  # a partial block is never shared
        ids = r.all_token_ids
        return any(o.num_computed <= start and start + BLOCK_SIZE <= o.num_computed + n
                   and o.all_token_ids[start:end] == ids[start:end]  # the block itself first: cheap, usually decisive
                   and o.all_token_ids[:start] == ids[:start] for o, n in chunks.items())

    def _use_prefix_cache(self, r: Request) -> None:
        """Start the request's prefill after the longest prefix the cache holds: whole blocks, then (where a
        chunk may start inside a block) the positions of a partly filled block that continue it, and at least
        its last prompt token left to compute, whose logits give the first output token. Later, while every
        block the request holds came from the cache, take the blocks the cache has gained since (another
        request's chunk computed them from the same tokens)."""
        if r.needs_prompt_logprobs:
            return  # every prompt row's logits are needed: nothing may come from the cache
        limit = r.prefill_end if r.resumed else r.prefill_end - 1
        if r.prefix_checked and (r.num_computed % BLOCK_SIZE or r.num_computed + BLOCK_SIZE > limit):
            return
        blocks, draft_blocks = self.pool.match(r.all_token_ids, limit)
        first, before = not r.prefix_checked, r.num_computed
        if not first:
            have = before // BLOCK_SIZE
            if len(blocks) <= have or self.pool.blocks(r.slot)[:have] != blocks[:have]:
                return
        r.prefix_checked = True
        part = self.pool.match_partial(r.all_token_ids, blocks, limit) if self.target.chunks_start_anywhere else None
        self.pool.attach(r.slot, blocks)
        r.num_computed = len(blocks) * BLOCK_SIZE
        if part is not None and self.pool.num_free_blocks > 0:
            # the next positions, copied out of a block another sequence holds (its owner only writes past them)
            self.pool.ensure(r.slot, r.num_computed + part[1])
            self.target.kv_cache.copy_positions(part[0], self.pool.blocks(r.slot)[-1], part[1])
            r.num_computed += part[1]
        r.draft_computed = draft_blocks * BLOCK_SIZE if self.draft_runner is not None else 0
        if not r.resumed:
            self.pool.count_query(r.prefill_end if first else 0, r.num_computed - before)
            r.metrics.num_cached_tokens = r.num_computed

    def _make_room(self, reqs: list[Request]) -> list[Request]:
        """Blocks for this step's verification rows (and the draft model's) of each decoding request, oldest
        first; the ones that cannot get them are preempted. Returns the requests still running."""
        reach = self.proposer.max_k if self.proposer is not None else 0
        for r in reqs:
            if r.status is Status.RUNNING and not self._reserve(r, min(len(r.all_token_ids) + reach,
                                                                       self.max_model_len)):
                self._release(r, preempt=True)
        return [r for r in reqs if r.status is Status.RUNNING]

    def _reserve(self, r: Request, num_tokens: int, preempt: bool = True) -> bool:
        """Blocks for positions [0, num_tokens) of ``r``, preempting requests admitted after it while the
        cache is short (unless not ``preempt``); False when only older requests hold the rest (``r`` then waits
        for them)."""
        while self.pool.blocks_needed(r.slot, num_tokens) > self.pool.num_free_blocks:
            running = self.scheduler.running
            younger = running[running.index(r) + 1:]
            if not younger or not preempt:
                return False
            victim = younger[-1]
            logger.warning("KV cache full: request %s is preempted and will be prefilled again "
                           "(raise kv_cache_memory or lower max_num_seqs).", victim.request_id)
            self._release(victim, preempt=True)
        self.pool.ensure(r.slot, num_tokens)
        return True

    def _release(self, r: Request, preempt: bool = False) -> None:
        """Give back the request's slot. Its full blocks stay in the prefix cache, the generated tokens' as well
        as the prompt's: a chat's next turn re-sends this answer, and a preempted request is prefilled again.
        Row invariance makes a decode step's keys and values the bits a prefill of the same tokens writes."""
        if r.slot is not None:
            done = min(r.num_computed, len(r.all_token_ids))  # accepted drafts a stop cut off are not content
            self.pool.register(r.slot, r.all_token_ids, done, min(r.draft_computed, done))
        if preempt:
            self.scheduler.preempt(r)
        else:
            self.scheduler.release(r)

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

    def _prefill(self, reqs: list[Request], chunks: dict[Request, int]) -> None:
        """Prefill the next ``chunks[r]`` prompt tokens of each request in one target pass; at a prompt's end,
        sample its first output token."""
        starts = {r: r.num_computed for r in reqs}
        seqs = [(r.slot, starts[r], r.all_token_ids[starts[r]:starts[r] + chunks[r]]) for r in reqs]
        every_row = [r.needs_prompt_logprobs for r in reqs]
        logits = self.target.prefill_many(seqs, every_row)
        self._prefilled(reqs, chunks, starts, {r: lg if e else lg[None] for r, lg, e in zip(reqs, logits, every_row)})

    def _prefilled(self, reqs: list[Request], chunks: dict[Request, int], starts: dict[Request, int],
                   logits: dict[Request, torch.Tensor]) -> None:
        """After a pass computed each request's chunk (``logits``: its rows' [n, V], every row for a request that
        wants its prompt's logprobs, else the last): advance, register the blocks, note prompt logprobs, and at
        a prompt's end sample its first output token."""
        for r in reqs:
            start, lg = starts[r], logits[r]
            if r.needs_prompt_logprobs:
                self._note_prompt_logprobs(r, start, lg)
            lg = lg[-1]
            r.num_computed = start + chunks[r]
            self.pool.register(r.slot, r.all_token_ids, r.num_computed, r.draft_computed)
            if r.prefilling or r.resumed:
                continue
            result = rejection_sample(self._target_probs([r], [lg[None]], [[]]), [[]], [0], None,
                                      [r.argmax_rows], [None])
            r.metrics.first_token_time = time.time()
            if self.proposer is not None:
                self.proposer.note_target(r, lg)
                self.proposer.prefill(r)
            self._commit(r, result.tokens[0], lg[None])

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
                for r in reqs]

    def _decode(self, reqs: list[Request], join_prompts: bool = False) -> None:
        """One step of the running requests: propose, verify in one target pass, rejection-sample, commit,
        observe. With ``join_prompts``, the step's prompt chunks ride in the same pass where that is exact
        (``_join_prompts``)."""
        proposer = self.proposer
        budgets = self._budgets(reqs)
        if proposer:
            s = self.scheduler
            proposer.expect_batch(min(len(s.running) + len(s.waiting), self.config.max_num_seqs))
        # Structured outputs: the engine drafts the text the grammar forces, the proposer drafts after it, and
        # its drafts are cut where the grammar forbids them.
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
        drafts = prop.tokens
        self._rows = sum(1 + len(d) for d in drafts)
        seqs = [(r.slot, r.num_computed, [r.all_token_ids[-1]] + d) for r, d in zip(reqs, drafts)]
        chunks = self._join_prompts(seqs) if join_prompts else {}
        logits = self.target.forward_rows(seqs, all_logits=[True] * len(reqs)
                                          + [r.needs_prompt_logprobs for r in chunks])
        if chunks:
            self._joined = (chunks, {r: r.num_computed for r in chunks}, dict(zip(chunks, logits[len(reqs):])))
        result = self._rejection_sample(reqs, logits[:len(reqs)], prop)
        for i, r in enumerate(reqs):
            a, emitted = result.num_accepted[i], result.tokens[i]
            r.num_computed = len(r.all_token_ids) + a  # rejected drafts' KV stays in place, just past the length
            if drafts[i]:
                r.metrics.spec_decode.record(len(drafts[i]), a)
                self.spec_stats.record(len(drafts[i]), a)
            f = len(forced[i])
            if proposer is not None:
                proposer.rollback(r, r.num_computed)
                proposer.note_target(r, logits[i][f if a >= f else 0])  # where the proposer's drafts began
            self._commit(r, emitted, logits[i])
            r.num_forced += min(a, f)
            if a < f:
                learn_spelling(r, forced[i], a, emitted)
            if proposer is not None and a >= f:
                # The proposer learns from its own drafts only; where forced text was rejected, they went untested.
                # Text-lookup drafts are the engine's, not the proposer's: for it, this step drafted nothing.
                own, ok = ([], 0) if r.text_drafted else (drafts[i][f:], a - f)
                proposer.observe(r, own, ok, emitted[f:])

    def _join_prompts(self, seqs: list[tuple[int, int, list[int]]]) -> dict[Request, int]:
        """Pick the step's prompt chunks (within what the verification rows leave of the budget) and append them
        to ``seqs``, to be computed in the verification pass: one read of the weights for both. Only where
        prompt rows take the decode rows' path (the C++ stack), so each row's result is what a prefill pass
        would give; elsewhere the chunks get their own pass after this one."""
        # (the prompt check first: chunks_start_anywhere checks the layer stack's weights, a few hundred lookups)
        if (not any(r.prefilling and not r.finished for r in self.scheduler.running)
                or not self.target.chunks_start_anywhere):
            return {}
        # no preemption here: the requests being verified in this pass must keep their blocks
        chunks = self._prefill_chunks(self.max_num_batched_tokens - self._rows, preempt=False)
        seqs += [(r.slot, r.num_computed, r.all_token_ids[r.num_computed:r.num_computed + n])
                 for r, n in chunks.items()]
        return chunks

    def _rejection_sample(self, reqs: list[Request], logits: list[torch.Tensor], prop: Proposal):
        drafts, draft_probs = prop.tokens, prop.probs
        return rejection_sample(self._target_probs(reqs, logits, drafts), drafts, [len(d) for d in drafts],
                                draft_probs, [r.argmax_rows for r in reqs], [None] * len(reqs))

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

    def _commit(self, r: Request, tokens: list[int], logits: torch.Tensor) -> None:
        """Append emitted tokens one by one, stopping exactly where plain decoding would stop."""
        lps = (logprobs_of(logits[:len(tokens)], tokens, r.params.logprobs, self.token_text)
               if r.logprobs is not None else None)
        for j, t in enumerate(tokens):
            r.all_token_ids.append(t)
            self.num_generation_tokens += 1
            if lps is not None:
                r.logprobs.append(lps[j])
                r.cumulative_logprob += lps[j][t].logprob
            r.detok.add(t)
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
