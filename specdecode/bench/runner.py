"""Runs the baseline and speculative configs over a prompt set, interleaved, on one loaded engine.

Engine sharing: the target model (and the draft model, when any config uses one) is loaded exactly once.
Before each generation the runner switches the engine to the config being measured with
``engine.set_speculative`` (None for the baseline). The engine keeps one proposer per config, so each config
keeps what it learned (adaptive k's acceptance, suffix decoding's cache of earlier outputs) as it would
running alone, and every config runs on the very same target weights, KV cache and threads, which is what a
fair speedup needs.

Interleaving: for each prompt, every config runs once before the next prompt starts, and the order of configs
rotates from prompt to prompt, so slow drifts of the machine (thermal, other load) hit all configs alike.
Before measuring, each config makes one warm-up generation that is not counted, and that its proposer then
forgets (``LLMEngine.reset_speculative_state``).

Timing: TTFT runs from adding the request to its first token (the target's prefill). Decode time runs from
the first token to the last, minus the draft model's own pass over the prompt, which this engine does lazily
at the first step that drafts with it; the proposer times it (``Proposer.prefill_seconds``) and it is
reported apart (``draft_prefill_s``) because it belongs to the prefill phase (vLLM runs it in the prefill
step). End-to-end latency includes everything.

Memory: all configs share one process, so RSS cannot be split between them exactly. Per config we report the
peak RSS sampled after every engine step while that config ran (``peak_rss_mb``; process-wide, so it includes
models other configs loaded) and the bytes of weights and KV cache of the models that config actually uses
(``model_memory_mb``: the target alone for baseline and n-gram, target + draft for draft configs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

from specdecode.bench.datasets import Dataset
from specdecode.speculative.metrics import SpecDecodeStats

logger = logging.getLogger("specdecode")

# hybrid: n-gram lookup first, the draft model where nothing matches; suffix: suffix decoding; suffix-draft:
# suffix matches first, the draft model where none is found
METHODS = ("ngram", "draft", "hybrid", "suffix", "suffix-draft")
DRAFT_METHODS = ("draft", "hybrid", "suffix-draft")  # the methods that run the draft model
LOOKUP_METHODS = ("hybrid", "suffix-draft")  # the methods with a lookup cap of their own (lookup_k)

MEMORY_NOTE = ("peak_rss_mb: process RSS (psutil) sampled after every engine step while the config ran; all "
               "configs share one process and one loaded target, so it includes every loaded model. "
               "model_memory_mb: weights + KV cache of the models the config uses (target, plus draft for "
               "draft configs).")


@dataclass(frozen=True)
class BenchConfig:
    name: str
    method: str | None  # None (baseline) or one of METHODS
    k: int = 0
    p_min: float = 0.0  # draft / hybrid: SpeculativeConfig.draft_p_min
    confidence: float = 0.0  # draft / hybrid: SpeculativeConfig.draft_confidence
    vocab: int | None = None  # draft / hybrid: SpeculativeConfig.draft_vocab_size (None: the full LM head)
    lookup_k: int | None = None  # hybrid / suffix-draft: SpeculativeConfig.prompt_lookup_num_tokens (None: k)


def make_configs(methods: list[str], ks: list[int], p_mins: list[float] = (0.0,),
                 vocab_sizes: list[int | None] = (None,), lookup_ks: list[int | None] = (None,),
                 confidences: list[float] = (0.0,)) -> list[BenchConfig]:
    """Baseline first, then each method x k (x draft_p_min x draft_confidence x draft_vocab_size for the
    methods that run the draft model, x lookup k for hybrid and suffix-draft)."""
    configs = [BenchConfig("baseline", None, 0)]
    for m in methods:
        for k in ks:
            draft = m in DRAFT_METHODS
            for p, c, v in itertools.product(*((p_mins, confidences, vocab_sizes) if draft else
                                               ((0.0,), (0.0,), (None,)))):
                for lk in (lookup_ks if m in LOOKUP_METHODS else (None,)):
                    lk = None if lk == k else lk
                    name = (f"{m} k={k}" + (f" p={p:g}" if p else "") + (f" c={c:g}" if c else "")
                            + (f" v={v}" if v else "") + (f" lookup={lk}" if lk else ""))
                    configs.append(BenchConfig(name, m, k, p, c, v, lk))
    return list(dict.fromkeys(configs))


@dataclass
class BenchSettings:
    model: str | None = None          # None: the default target
    draft_model: str | None = None    # None: the default draft (only used if a config needs a draft)
    methods: list[str] = field(default_factory=lambda: ["ngram", "draft"])
    ks: list[int] = field(default_factory=lambda: [2, 4])
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    ignore_eos: bool = False
    chat_template: str = "auto"       # "auto" (when the tokenizer has one), "on", "off"
    ngram_min: int | None = None      # None: config.default_lookup_min (1 for ngram, 3 for hybrid)
    ngram_max: int = 4
    lookup_ks: list[int | None] = field(default_factory=lambda: [None])  # hybrid: the most tokens one lookup
    # drafts, one config per value (None: the config's k)
    dtype: str = "auto"
    quantization: str | None = None
    num_threads: int | None = None
    max_model_len: int | None = None
    warmup: bool = True
    progress: bool = True
    adaptive: bool = False            # engine-chosen k per step, up to each config's k
    draft_p_mins: list[float] = field(default_factory=lambda: [0.0])  # draft / hybrid: one config per value
    draft_confidences: list[float] = field(default_factory=lambda: [0.0])  # draft / hybrid: the same
    draft_vocab_sizes: list[int | None] = field(default_factory=lambda: [None])  # draft / hybrid: one config
    token_map: str | None = None  # per value; None: the full LM head. token_map: the ranking sizes cut from
    draft_quantization: str | None = None  # draft configs: the draft's weight format (None: the target's)
    compile: bool = False             # torch.compile the decode / verification layers (EngineConfig.compile)
    draft_window: int | None = None   # draft configs: the draft's bounded context (None: the default)


@dataclass
class PromptRun:
    prompt_id: str
    category: str
    config: str
    prompt_tokens: int
    output_token_ids: list[int]
    ttft_s: float
    decode_time_s: float
    e2e_s: float
    finish_reason: str | None
    spec: SpecDecodeStats
    peak_rss_mb: float
    draft_prefill_s: float = 0.0
    weight_bytes_read: int = 0  # weights streamed by the decode/verify passes of target and draft
    # the decode/verify passes, as (draft model's, rows, context), for modeled_decode_s
    passes: list[tuple[bool, int, int]] = field(default_factory=list)
    # the passes' seconds by the calibrated pass costs (see modeled_seconds; with the draft's prefill, which
    # decode_time_s leaves out), None without a calibration
    modeled_decode_s: float | None = None
    match_baseline: bool | None = None
    first_diff_position: int | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def as_dict(self) -> dict:
        n = self.num_output_tokens
        return {"prompt_id": self.prompt_id, "category": self.category, "config": self.config,
                "prompt_tokens": self.prompt_tokens, "output_tokens": n, "finish_reason": self.finish_reason,
                "ttft_s": self.ttft_s, "draft_prefill_s": self.draft_prefill_s, "decode_time_s": self.decode_time_s,
                "e2e_latency_s": self.e2e_s,
                "decode_tokens_per_s": (n - 1) / self.decode_time_s if n > 1 and self.decode_time_s > 0 else None,
                "weight_bytes_read": self.weight_bytes_read, "modeled_decode_s": self.modeled_decode_s,
                "peak_rss_mb": self.peak_rss_mb, "match_baseline": self.match_baseline,
                "first_diff_position": self.first_diff_position, "spec_decode": self.spec.as_dict(),
                "output_token_ids": self.output_token_ids}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing output token, or None if the sequences are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def modeled_seconds(passes: list[tuple[bool, int, int]], costs) -> float | None:
    """What ``passes`` ((draft model's, rows, context) each) cost by the calibrated pass costs ``costs``
    (a CostModel): a decode time free of the machine's minute-to-minute noise. A proposer's decisions do not
    depend on the clock, so two configs' modeled times differ only by the passes they chose; what the
    proposers' own bookkeeping costs is not in it."""
    total = 0.0
    for is_draft, rows, context in passes:
        c = costs.draft_cost(context, rows) if is_draft else costs.verify_cost(rows, context)
        if c is None:
            return None
        total += c
    return total


@contextlib.contextmanager
def logged_passes(target, draft, log: list[tuple[bool, int, int]]):
    """Appends each decode/verify pass of the runners ``target`` and ``draft`` (or None), and each prefill of
    the draft, to ``log`` as (draft model's, rows, context) while the block runs. The draft's prefill is in:
    it happens after the first token, so a served stream waits for it (the target's prefill is before)."""
    wrapped = []
    for is_draft, runner in ((False, target), (True, draft)):
        if runner is None:
            continue
        names = ("forward_rows", "prefill_many") if is_draft else ("forward_rows",)
        for name in names:
            inner = getattr(runner, name)

            def logged(seqs, *args, _inner=inner, _draft=is_draft, **kwargs):
                rows = sum(len(toks) for _, _, toks in seqs)
                log.append((_draft, rows, sum(start for _, start, _ in seqs) // len(seqs)))
                return _inner(seqs, *args, **kwargs)

            setattr(runner, name, logged)
            wrapped.append((runner, name))
    try:
        yield
    finally:
        for runner, name in wrapped:
            delattr(runner, name)


def _rss_mb() -> float:
    try:
        import psutil
        return psutil.Process().memory_info().rss / 2**20
    except Exception:  # psutil missing or /proc unavailable: fall back to the lifetime peak
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _max_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def module_bytes(module) -> int:
    """Bytes of all tensors a module holds: parameters, buffers and tensor attributes (KV caches, packed
    quantized weights), each storage counted once."""
    import torch

    def held(obj) -> list:
        """Tensors an attribute value holds directly, or one level down (e.g. a packed-weight object)."""
        if isinstance(obj, torch.Tensor):
            return [obj]
        if isinstance(obj, dict):
            return [v for v in obj.values() if isinstance(v, torch.Tensor)]
        if isinstance(obj, (torch.nn.Module, str, bytes, int, float, type(None))):
            return []
        attrs = list(getattr(obj, "__dict__", {}).values())
        for slot in getattr(type(obj), "__slots__", ()):
            attrs.append(getattr(obj, slot, None))
        out = []
        for a in attrs:
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, dict):
                out += [v for v in a.values() if isinstance(v, torch.Tensor)]
        return out

    seen, total = set(), 0
    for m in module.modules():
        tensors = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        for v in vars(m).values():
            tensors += held(v)
        for t in tensors:
            if t.device.type == "meta":
                continue
            key = (t.untyped_storage().data_ptr(), t.device.type)
            if key in seen:
                continue
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def linear_weight_bytes(model) -> int:
    """Bytes of the weights one decode pass streams from memory: every linear layer (as stored: packed int8
    plus scales, bf16 or fp32). The embedding table is left out, since a pass reads one row of it."""
    from specdecode.layers.linear import Linear

    total = 0
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        if m.packed is not None:
            total += m.packed.weight.nbytes + (m.packed.scale.nbytes if m.packed.scale is not None else 0)
        elif m.weight is not None:
            total += m.weight.nbytes
        if m.bias is not None:
            total += m.bias.nbytes
    return total


def measure_memory_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """The machine's read bandwidth in GB/s as torch sees it: best time to sum a buffer far larger than any
    cache, on the current thread count. The ceiling that decode (weight streaming) can reach."""
    import torch

    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    buf.sum()  # touch every page before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9


def run_timed(engine, rid: str, ids: list[int], params, on_step=None, should_abort=None) -> dict:
    """Runs one request to the end on ``engine`` and times it: request added (t0), first token, last token.

    ``on_step(output)`` runs after every engine step with this request's output of that step (or None);
    ``should_abort()`` is polled before each step and aborts the request once it returns True. The draft's
    prefill time is what the proposer spent on it meanwhile (``Proposer.prefill_seconds``)."""
    proposer = engine.proposer
    prefill0 = proposer.prefill_seconds if proposer is not None else 0.0
    t0 = time.perf_counter()
    engine.add_request(rid, None, params, prompt_token_ids=ids)
    t_first = t_end = final = None
    aborted = False
    while final is None:
        if should_abort is not None and not aborted and should_abort():
            engine.abort_request(rid)
            aborted = True
        outs = engine.step()
        now = time.perf_counter()
        mine = next((o for o in outs if o.request_id == rid), None)
        if mine is not None:
            if t_first is None and mine.outputs[0].token_ids:
                t_first = now
            if mine.finished:
                final, t_end = mine, now
        if on_step is not None:
            on_step(mine)
        if final is None and not engine.has_unfinished_requests():
            raise RuntimeError("the engine stopped without finishing the request")
    return {"output": final, "t0": t0, "t_first": t_end if t_first is None else t_first, "t_end": t_end,
            "aborted": aborted,
            "draft_prefill": proposer.prefill_seconds - prefill0 if proposer is not None else 0.0}


class BenchRunner:
    def __init__(self, settings: BenchSettings):
        self.s = settings
        self.configs = make_configs(settings.methods, settings.ks, settings.draft_p_mins, settings.draft_vocab_sizes,
                                    settings.lookup_ks, settings.draft_confidences)
        self.engine = None
        self.use_chat = False
        self._counter = 0
        self._spec: dict[str, object] = {}
        self._model_mb: dict[str | None, float] = {}
        self.draft_path = None
        self._ngram_mins: dict[str, int] = {}

    # ---- setup ----
    def load(self) -> None:
        from specdecode.engine.llm_engine import LLMEngine

        s = self.s
        need_draft = any(m in DRAFT_METHODS for m in s.methods)
        kw = dict(model=s.model, max_num_seqs=1, dtype=s.dtype, quantization=s.quantization, seed=s.seed,
                  num_threads=s.num_threads, max_model_len=s.max_model_len, compile=s.compile)
        kmax = max(s.ks + [lk for lk in s.lookup_ks if lk and "hybrid" in s.methods]) if s.ks else 1
        from specdecode.config import default_lookup_min
        ngram_min = s.ngram_min or default_lookup_min(False, s.ngram_max)
        hybrid_min = s.ngram_min or default_lookup_min(True, s.ngram_max)
        self._ngram_mins = {"ngram": ngram_min, "hybrid": hybrid_min}
        if need_draft:
            # k given: a fixed-k config (no preset policy); 0: the full draft head, each config sets its own.
            kw.update(speculative_model=s.draft_model or "default", num_speculative_tokens=kmax,
                      speculative_token_map=s.token_map, speculative_draft_vocab_size=0,
                      speculative_model_quantization=s.draft_quantization,
                      speculative_draft_window=s.draft_window)
        elif "ngram" in s.methods:
            kw.update(speculative_model="[ngram]", num_speculative_tokens=kmax,
                      ngram_prompt_lookup_min=ngram_min, ngram_prompt_lookup_max=s.ngram_max)
        else:
            kw.update(speculative_method="none")  # no preset draft for configs that need none
        eng = self.engine = LLMEngine.from_kwargs(**kw)
        target_mb = module_bytes(eng.target.model) / 2**20
        self._weight_bytes = {"target": linear_weight_bytes(eng.target.model)}
        self._model_mb = {m: target_mb for m in (None,) + METHODS}
        runner = eng.draft_runner
        if runner is not None:
            self.draft_path = eng.draft_path
            self._weight_bytes["draft"] = linear_weight_bytes(runner.model)
            for m in DRAFT_METHODS:
                self._model_mb[m] = target_mb + module_bytes(runner.model) / 2**20
        self.memory_bandwidth_gbps = measure_memory_bandwidth()
        from specdecode.config import SpeculativeConfig
        base = eng.config.speculative
        for c in self.configs:
            if c.method == "ngram":
                self._spec[c.name] = SpeculativeConfig(method="ngram", num_speculative_tokens=c.k,
                                                       prompt_lookup_min=ngram_min, prompt_lookup_max=s.ngram_max,
                                                       adaptive=s.adaptive)
            elif c.method == "suffix":
                self._spec[c.name] = SpeculativeConfig(method="suffix", num_speculative_tokens=c.k,
                                                       adaptive=s.adaptive)
            elif c.method in DRAFT_METHODS:
                hybrid = c.method == "hybrid"
                lookups = c.method in LOOKUP_METHODS
                self._spec[c.name] = dataclasses.replace(
                    base, method="suffix" if c.method == "suffix-draft" else "draft_model",
                    num_speculative_tokens=c.k, adaptive=s.adaptive, draft_p_min=c.p_min,
                    draft_confidence=c.confidence, ngram_first=hybrid,
                    draft_vocab_size=c.vocab, token_map=base.token_map if c.vocab else None,
                    prompt_lookup_min=hybrid_min if hybrid else base.prompt_lookup_min,
                    prompt_lookup_max=s.ngram_max if hybrid else base.prompt_lookup_max,
                    prompt_lookup_num_tokens=c.lookup_k if lookups else None)
        has_template = bool(getattr(eng.tokenizer, "chat_template", None))
        if s.chat_template == "on" and not has_template:
            raise ValueError("--chat-template on: this model's tokenizer has no chat template")
        self.use_chat = has_template if s.chat_template == "auto" else s.chat_template == "on"

    def _activate(self, cfg: BenchConfig) -> None:
        # The engine keeps one proposer per config: each learns its own acceptance, as it would running alone.
        self.engine.set_speculative(self._spec.get(cfg.name))

    def encode(self, text: str) -> list[int]:
        from specdecode.tokenizer import apply_chat_template

        if self.use_chat:
            text = apply_chat_template(self.engine.tokenizer, [{"role": "user", "content": text}])
        return self.engine.input_processor.encode_prompt(text)

    def _params(self, index: int, max_tokens: int):
        from specdecode.sampling_params import SamplingParams

        s = self.s
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=max_tokens,
                              seed=None if s.temperature == 0 else s.seed + index, ignore_eos=s.ignore_eos)

    # ---- one generation ----
    def generate(self, cfg: BenchConfig, ids: list[int], params, prompt_id: str = "", category: str = "") -> PromptRun:
        self._activate(cfg)
        eng = self.engine
        eng.reset_prefix_cache()  # every config prefills the prompt cold, as it would running alone
        rid = f"bench-{self._counter}"
        self._counter += 1
        rss = [_rss_mb()]  # sampled after every engine step
        draft_runner = eng.proposer.draft_runner if eng.proposer is not None else None
        passes0 = (eng.target.num_passes, draft_runner.num_passes if draft_runner is not None else 0)
        passes: list[tuple[bool, int, int]] = []
        with logged_passes(eng.target, draft_runner, passes):
            run = run_timed(eng, rid, ids, params, on_step=lambda _: rss.append(_rss_mb()))
        final, t0, t_first, t_end = run["output"], run["t0"], run["t_first"], run["t_end"]
        c = final.outputs[0]
        spec = final.metrics.spec_decode if final.metrics is not None else SpecDecodeStats()
        draft_prefill = run["draft_prefill"]
        read = (eng.target.num_passes - passes0[0]) * self._weight_bytes["target"]
        if draft_runner is not None:
            read += (draft_runner.num_passes - passes0[1]) * linear_weight_bytes(draft_runner.model)  # this head
        return PromptRun(prompt_id, category, cfg.name, len(ids), list(c.token_ids), t_first - t0,
                         max(0.0, t_end - t_first - draft_prefill), t_end - t0, c.finish_reason, spec, max(rss),
                         draft_prefill_s=draft_prefill, weight_bytes_read=read, passes=passes)

    # ---- the whole run ----
    def run(self, dataset: Dataset) -> dict:
        from tqdm import tqdm

        from specdecode.bench.report import summarize

        if self.engine is None:
            self.load()
        s = self.s
        prepared, skipped = [], []
        for p in dataset.prompts:
            try:
                prepared.append((p, self.encode(p.text)))
            except ValueError as e:
                skipped.append({"prompt_id": p.id, "category": p.category, "reason": str(e)})
        if skipped:
            logger.warning("skipped %d prompt(s) that do not fit: %s", len(skipped), skipped[0]["reason"])
        if not prepared:
            raise ValueError("no prompt of the dataset fits the model's context; raise --max-model-len")
        t_start = time.perf_counter()
        if s.warmup:
            _, short = min(prepared, key=lambda x: len(x[1]))
            for cfg in self.configs:
                self.generate(cfg, short, self._params(0, min(s.max_tokens, 16)))
            self.engine.reset_speculative_state()  # a 16-token warm-up is not an answer length to learn from
        runs: list[PromptRun] = []
        n_cfg = len(self.configs)
        with tqdm(total=len(prepared), desc="bench", unit="prompt", file=sys.stderr, disable=not s.progress,
                  dynamic_ncols=True) as bar:
            for i, (p, ids) in enumerate(prepared):
                order = [self.configs[(i + j) % n_cfg] for j in range(n_cfg)]  # rotate the order per prompt
                by_cfg = {}
                for cfg in order:
                    bar.set_postfix_str(f"{p.category} / {cfg.name}", refresh=False)
                    by_cfg[cfg.name] = self.generate(cfg, ids, self._params(i, s.max_tokens), p.id, p.category)
                base = by_cfg["baseline"]
                for cfg in self.configs:
                    r = by_cfg[cfg.name]
                    r.first_diff_position = first_difference(r.output_token_ids, base.output_token_ids)
                    r.match_baseline = r.first_diff_position is None
                    runs.append(r)
                bar.update(1)
        wall = time.perf_counter() - t_start
        costs = self._pass_costs()
        for r in runs:
            r.modeled_decode_s = modeled_seconds(r.passes, costs) if costs is not None else None
        self._activate(self.configs[-1])
        meta = self._meta(dataset, len(prepared), skipped, wall)
        return summarize(runs, self.configs, dataset.categories, meta, self._model_mb)

    def _pass_costs(self):
        """The calibrated pass costs of the speculative configs (one calibration serves them all), or None."""
        for cfg in self.configs:
            if cfg.method is None:
                continue
            self._activate(cfg)
            policy = getattr(self.engine.proposer, "policy", None)
            costs = getattr(policy, "costs", None)
            if costs is not None and costs.verify:
                return costs
        return None

    def _meta(self, ds: Dataset, used: int, skipped: list, wall: float) -> dict:
        import torch

        from specdecode.layers import kernels

        s, eng = self.s, self.engine
        return {
            "target": str(eng.model_path), "draft": str(self.draft_path) if self.draft_path else None,
            "dataset": ds.name, "dataset_format": ds.format, "dataset_note": ds.note,
            "num_prompts_used": used, "skipped_prompts": skipped,
            "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "greedy": s.temperature == 0, "seed": s.seed, "ignore_eos": s.ignore_eos, "adaptive_k": s.adaptive,
            "draft_p_min": s.draft_p_mins, "draft_confidence": s.draft_confidences,
            "draft_vocab_size": s.draft_vocab_sizes,
            "token_map": s.token_map,
            "draft_quantization": s.draft_quantization, "draft_window": s.draft_window,
            "chat_template": self.use_chat, "ngram_min": self._ngram_mins, "ngram_max": s.ngram_max,
            "lookup_k": s.lookup_ks,
            "dtype": s.dtype, "quantization": s.quantization, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "processor": platform.processor() or None, "load_time_s": eng.load_time, "bench_wall_time_s": wall,
            "warmup": "one excluded generation per config" if s.warmup else "none",
            "interleaving": "per prompt, all configs, order rotated each prompt",
            "engine_sharing": "one engine: target (and draft) loaded once; engine.set_speculative per config",
            "timing_note": "decode tokens/s = (output tokens - 1) / (last token time - first token time - draft "
                           "prefill time); TTFT = first token time - request time",
            "process_peak_rss_mb": _max_rss_mb(), "memory_note": MEMORY_NOTE,
            "memory_bandwidth_gbps": self.memory_bandwidth_gbps,
            "cpu_kernel": kernels.describe() if eng.target.device.type == "cpu" else None,
            "weight_bytes": self._weight_bytes,
            "bandwidth_note": "weight GB/s = linear-layer bytes streamed by the decode/verify passes of target "
                              "and draft / decode time; memory_bandwidth_gbps = best time to sum a 1 GiB buffer",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }


# ---- verification cost ----
def verify_cost(engine, sizes: list[int], prefill_len: int = 64, repeats: int = 5) -> list[dict]:
    """Times one target forward pass over n query tokens after a prefill of ``prefill_len`` tokens.

    Returns rows {"tokens", "ms_median", "ms_min", "relative"} where relative is against the first size."""
    import torch

    tok = engine.tokenizer
    text = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
            "Speculative decoding verifies several drafted tokens in a single pass of the target model. ")
    ids = tok.encode(text)
    need = prefill_len + max(sizes)
    while len(ids) < need:
        ids = ids + ids
    if need >= engine.max_model_len:
        raise ValueError(f"--prefill {prefill_len} plus {max(sizes)} query tokens exceed max_model_len "
                         f"({engine.max_model_len})")
    runner = engine.target
    slot = 0
    rows = []
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        runner.prefill(slot, ids[:prefill_len])
        for n in sizes:  # warm-up: first call of each shape
            runner.forward_rows([(slot, prefill_len, ids[prefill_len:prefill_len + n])], all_logits=True)
        for _ in range(repeats):  # sizes interleaved within each round, so drift hits all of them alike
            for n in sizes:
                q = ids[prefill_len:prefill_len + n]
                t0 = time.perf_counter()
                runner.forward_rows([(slot, prefill_len, q)], all_logits=True)
                times[n].append(time.perf_counter() - t0)
    for n in sizes:
        rows.append({"tokens": n, "ms_median": 1000 * statistics.median(times[n]), "ms_min": 1000 * min(times[n])})
    ref = rows[0]["ms_median"]
    for r in rows:
        r["relative"] = r["ms_median"] / ref if ref > 0 else None
    return rows
