"""--compile (EngineConfig.compile): the layers that decode / verification rows run in Python, compiled with
torch.compile, still give every row the same logits whatever rows share the pass, stay close to eager, and
keep greedy output identical with and without speculation."""
from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.model_runner import ModelRunner
from specdecode.models.loader import load_model


def eager_and_compiled_rows(path, quantization: str | None, ids: list[int]) -> dict[str, torch.Tensor]:
    """The logits of ids[16:] after a prefill of ids[:16], eager and compiled; each mode gives a row the same
    logits decoded one by one or verified together."""
    out = {}
    for mode in ("eager", "compiled"):
        r = ModelRunner(load_model(path, "float32", "cpu", 64, quantization), 1, 64, "cpu")
        r.model.fused_layers = False  # llama would otherwise take the C++ layer stack, which compile leaves be
        if mode == "compiled":
            r.model.compile_decode()
        r.prefill(0, ids[:16])
        one_by_one = torch.cat([r.forward_rows([(0, 16 + i, [t])], all_logits=True)[0]
                                for i, t in enumerate(ids[16:])])
        together = r.forward_rows([(0, 16, ids[16:])], all_logits=True)[0]
        assert torch.equal(one_by_one, together), mode
        out[mode] = together
    return out


@pytest.mark.parametrize("fam,quantization", [("gpt2", None), ("llama", "w8a8")])
def test_compiled_rows_are_invariant_and_match_eager(fam, quantization, tiny_models):
    ids = torch.randint(5, 500, (22,), generator=torch.Generator().manual_seed(0)).tolist()
    out = eager_and_compiled_rows(tiny_models[fam], quantization, ids)
    # Compiled elementwise code may round differently from eager (and int8 activations can then land one
    # step apart), but not by much.
    tol = 1e-3 if quantization is None else 5e-2
    assert (out["eager"] - out["compiled"]).abs().max().item() < tol
    assert torch.equal(out["eager"].argmax(-1), out["compiled"].argmax(-1))


def test_compiled_greedy_matches_with_and_without_speculation(tiny_models):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[11, 12, 13, 11, 12, 13, 11, 12], [40, 41, 42, 43, 44, 40, 41]]
    plain = LLM(str(tiny_models["gpt2"]), compile=True, max_model_len=96)
    assert plain.engine.target.model._compiled is not None
    spec = LLM(str(tiny_models["gpt2"]), speculative_model="[ngram]", num_speculative_tokens=3, compile=True,
               max_model_len=96)
    a = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params,
                                                         use_tqdm=False)]
    outs = spec.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == a
    assert sum(o.metrics.spec_decode.num_draft_tokens for o in outs) > 0


def test_compile_flag_is_validated():
    with pytest.raises(ValueError, match="compile must be True or False"):
        LLM("unused", compile="yes")
