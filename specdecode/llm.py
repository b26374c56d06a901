"""Offline entry points: vLLM's ``LLM`` and SGLang's ``Engine``."""
from __future__ import annotations

import sys
from typing import Any, Sequence

from specdecode.config import EngineConfig
from specdecode.engine.llm_engine import LLMEngine
from specdecode.outputs import RequestOutput
from specdecode.sampling_params import SamplingParams
from specdecode.speculative.metrics import SpecDecodeStats
from specdecode.tokenizer import apply_chat_template

PromptType = str | list[int] | dict
SGLANG_MAX_NEW_TOKENS = 128  # SGLang's default max_new_tokens


class LLM:
    """vLLM's offline entry point: ``LLM(model=..., speculative_config={...} or speculative_model=..., ...)``.

    Every keyword in any accepted spelling is listed by ``specdecode options`` (docs/options.md). What is not
    given comes from the ``fast`` preset (specdecode/presets.py): with no model at all, the built-in pair
    (Qwen2.5-Coder 1.5B target, 0.5B draft), on CPU with the target's weights ``mixed`` (its 4- and 6-bit GGUF
    tensors as stored, the rest w8a8) and the draft's ``w4a8``, prompt lookup first and the draft model where
    nothing matches, k chosen per step from measured acceptance and timed costs (bfloat16 weights on a GPU)."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.engine = LLMEngine(self.config)
        self._next_id = 0

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's attribute name)."""
        return self.engine

    def get_tokenizer(self):
        """transformers' tokenizer of the target, as vLLM returns it."""
        from specdecode.tokenizer import hf_tokenizer

        return hf_tokenizer(self.engine.tokenizer)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's method); False while requests are running."""
        return self.engine.reset_prefix_cache()

    @property
    def spec_decode_metrics(self) -> SpecDecodeStats:
        return self.engine.spec_stats

    def generate(self, prompts: PromptType | Sequence[PromptType] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, prompt_token_ids: list[list[int]] | None = None) -> list[RequestOutput]:
        """Completions of text prompts, token id lists or dicts (``{"prompt": ...}`` or ``{"prompt_token_ids":
        ...}``, as vLLM takes them; add ``"suffix"`` to have a code model fill in the middle between the two)."""
        items = self._normalise(prompts, prompt_token_ids)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"Got {len(items)} prompts but {len(params)} SamplingParams; pass one, or one per prompt.")
        # Encode everything first so a bad prompt fails before any work is queued.
        encoded = [self.engine.input_processor.encode_prompt(text, ids, suffix, p.truncate_prompt_tokens)
                   for (text, ids, suffix), p in zip(items, params)]
        return self._run([(t, e, p) for (t, _, _), e, p in zip(items, encoded, params)], use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None
             ) -> list[RequestOutput]:
        """Answers to one conversation or a list of them, rendered by the model's chat template (vLLM's
        keywords: ``tools`` and ``chat_template_kwargs`` go to the template; ``continue_final_message`` has the
        model go on with the last message, with ``add_generation_prompt=False``)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [apply_chat_template(self.engine.tokenizer, c, add_generation_prompt, tools=tools,
                                       continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    _PROMPT_KEYS = ("prompt", "prompt_token_ids", "suffix")

    @classmethod
    def _normalise(cls, prompts, prompt_token_ids) -> list[tuple[str | None, list[int] | None, str | None]]:
        """(text, token ids, suffix) of each prompt. A dict prompt takes vLLM's ``prompt`` or ``prompt_token_ids``
        and, to fill in the middle, a ``suffix`` (the prompt is then the text before the gap)."""
        if prompt_token_ids is not None:
            return [(None, list(ids), None) for ids in prompt_token_ids]
        if prompts is None:
            raise ValueError("generate() needs prompts: a string, a list of strings, or token id lists.")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        out = []
        for p in prompts:
            if isinstance(p, dict):
                unknown = sorted(str(k) for k in p if k not in cls._PROMPT_KEYS)
                if unknown:
                    raise ValueError(f"Unsupported prompt key(s) {', '.join(map(repr, unknown))}; a prompt dict takes "
                                     f"{', '.join(map(repr, cls._PROMPT_KEYS))}.")
                ids = p.get("prompt_token_ids")
                out.append((p.get("prompt"), None if ids is None else list(ids), p.get("suffix")))
            elif isinstance(p, str):
                out.append((p, None, None))
            elif isinstance(p, (list, tuple)):
                out.append((None, list(p), None))
            else:
                raise ValueError(f"Unsupported prompt type {type(p).__name__}; use str, list[int] or "
                                 "{'prompt_token_ids': [...]}.")
        return out

    def _run(self, work: list[tuple[str | None, list[int], SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        eng = self.engine
        ids, results = [], {}
        pending = list(enumerate(work))
        bar = tqdm(total=len(work), desc="Generating", unit="req", file=sys.stderr,
                   disable=not (use_tqdm and sys.stderr.isatty()))
        try:
            with bar:
                while pending or eng.has_unfinished_requests():
                    # Offline: keep the queue short so huge prompt lists never hit the waiting limit.
                    while pending and len(eng.scheduler.waiting) < eng.config.max_num_seqs:
                        i, (text, enc, p) = pending.pop(0)
                        rid = str(self._next_id)
                        self._next_id += 1
                        eng.add_request(rid, text, p, prompt_token_ids=enc)
                        ids.append(rid)
                    for out in eng.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
        except BaseException:
            # A bad prompt further down the list, or Ctrl+C: the call's requests already added leave the engine,
            # so that the next call starts clean.
            for rid in ids:
                eng.abort_request(rid)
            if eng.has_unfinished_requests():
                eng.step()
            raise
        return [results[r] for r in ids]


class Engine:
    """SGLang's offline entry point: ``Engine(model_path, speculative_draft_model_path=...,
    speculative_num_draft_tokens=k + 1, ...)``; SGLang's option names map through the option table."""

    def __init__(self, model_path: str | None = None, **kwargs: Any):
        self.llm = LLM(model_path, **kwargs)

    def generate(self, prompt: str | list[str], sampling_params: dict | None = None) -> dict | list[dict]:
        sp = dict(sampling_params or {})
        if "max_new_tokens" in sp:
            sp["max_tokens"] = sp.pop("max_new_tokens")
        sp.setdefault("max_tokens", SGLANG_MAX_NEW_TOKENS)
        if "stop_token_ids" in sp and sp["stop_token_ids"] is None:
            sp.pop("stop_token_ids")
        outs = self.llm.generate(prompt, SamplingParams(**sp), use_tqdm=False)
        res = [{"text": o.outputs[0].text, "output_ids": o.outputs[0].token_ids,
                "meta_info": {"finish_reason": o.outputs[0].finish_reason,
                              "prompt_tokens": len(o.prompt_token_ids),
                              "completion_tokens": len(o.outputs[0].token_ids),
                              "spec_verify_ct": o.metrics.spec_decode.num_drafts,
                              "spec_accepted_tokens": o.metrics.spec_decode.num_accepted_tokens}} for o in outs]
        return res[0] if isinstance(prompt, str) else res

    def shutdown(self) -> None:
        pass
