"""Shared fixtures and helpers for the speculative-decoding tests.

Test modules import what they need: ``from helpers_spec import one_thread, llm_cache, ...`` (pytest picks up
fixtures that a test module imports). Nothing here changes global state except ``one_thread``, which
restores the thread count when its scope ends.
"""
from __future__ import annotations

import logging

import json
import shutil
from pathlib import Path

import pytest
import torch

from tiny import VOCAB, build_model

GREEDY = dict(temperature=0.0, ignore_eos=True)

# Prompts of clearly different lengths (token ids < VOCAB), the first one repetitive so that n-gram lookup
# finds matches; every prompt is valid for every tiny model.
PROMPTS = [
    [17, 42, 99, 17, 42, 99, 17, 42, 99, 17, 42],
    [5],
    [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316, 317, 318, 319],
    [64, 128, 64, 256, 64, 128, 7],
]


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tiny-model work on one thread.

    On this 2-vCPU machine, alternating MKL (prefill) and ATen/OpenMP kernels (decode) at 2 threads makes
    the spinning thread pools fight: a tiny-model decode step takes ~20 ms instead of ~0.5 ms. The results
    are thread-count independent by design (row-invariant kernels), so one thread changes nothing but time.
    """
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


class LLMCache:
    """Builds each distinct LLM configuration once per session; engines are reused across tests."""

    def __init__(self):
        self._llms: dict[str, object] = {}

    def get(self, model, **kw):
        from specdecode import LLM

        kw.setdefault("max_model_len", 256)
        key = json.dumps([str(model), {k: (str(v) if isinstance(v, Path) else v) for k, v in kw.items()}],
                         sort_keys=True, default=str)
        if key not in self._llms:
            kw = {k: (str(v) if isinstance(v, Path) else v) for k, v in kw.items()}
            self._llms[key] = LLM(str(model), **kw)
        return self._llms[key]

    def clear(self):
        self._llms.clear()


@pytest.fixture(scope="session")
def llm_cache():
    cache = LLMCache()
    yield cache
    cache.clear()


def gen_ids(llm, prompts: list[list[int]], **params) -> list[list[int]]:
    from specdecode import SamplingParams

    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(**params), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def copy_model(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, **changes) -> None:
    cfg_file = Path(model_dir) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(changes)
    cfg_file.write_text(json.dumps(cfg, indent=2))


def add_weight_noise(model_dir: Path, scale: float, seed: int = 123) -> None:
    """Multiplies every 2-D weight by (1 + scale * N(0, 1)): a draft close to, but not equal to, the target."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    for f in Path(model_dir).glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if t.dim() == 2 and t.is_floating_point():
                tensors[name] = (t * (1 + scale * torch.randn(t.shape, generator=g))).contiguous()
        save_file(tensors, str(f), metadata={"format": "pt"})


def build_other_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with exactly vocab_size tokens, trained on text unlike the tiny corpus:
    same size as the tiny tokenizer, different vocabulary (the mismatch a size-only check would miss)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor. " * 3,
              "SELECT name, price FROM products WHERE price > 10 ORDER BY price DESC;\n",
              "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
              "{\"id\": 17, \"tags\": [\"x\", \"y\"], \"nested\": {\"ok\": true}}",
              "Pack my box with five dozen liquor jugs; sphinx of black quartz, judge my vow. " * 2,
              "fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); println!(\"{:?}\", v); }",
              "Il était une fois une petite souris qui habitait sous le plancher de la cuisine."]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 20, trainer)
    assert tok.get_vocab_size() == vocab_size, "corpus too small to reach the requested vocabulary size"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(str(out))


def scale_tensor(model_dir: Path, name: str, factor: float) -> None:
    from safetensors.torch import load_file, save_file

    for f in Path(model_dir).glob("*.safetensors"):
        tensors = load_file(str(f))
        if name in tensors:
            tensors[name] = (tensors[name] * factor).contiguous()
            save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def sharp_target(tiny_models, tiny_dir) -> Path:
    """The tiny llama with its (untied) lm_head scaled by 4: the random model's next-token distributions are
    nearly uniform over 512 tokens, this one's have ~13 effective categories at temperature 0.7, so
    distribution tests have power with a few thousand samples."""
    d = copy_model(tiny_models["llama"], tiny_dir / "llama_sharp")
    scale_tensor(d, "lm_head.weight", 4.0)
    return d


@pytest.fixture(scope="session")
def sharp_draft(sharp_target, tiny_dir) -> Path:
    """sharp_target with multiplicative weight noise: its distributions differ from the target's (about 35%
    of drafts are rejected) but drafts are accepted often enough to exercise every branch."""
    d = copy_model(sharp_target, tiny_dir / "llama_sharp_noisy")
    add_weight_noise(d, 0.15)
    return d


@pytest.fixture(scope="session")
def noisy_drafts(tiny_models, tiny_dir) -> dict[str, Path]:
    """family -> a copy of that family's tiny model with 10% multiplicative weight noise. As greedy drafts
    they are accepted partly (roughly 25-95% depending on the family), so verification rejects at many
    different positions and both KV caches roll back mid-run; a random unrelated draft is almost never
    accepted and would leave the rollback paths untested."""
    out = {}
    for fam, src in tiny_models.items():
        out[fam] = copy_model(src, tiny_dir / f"{fam}_noisy_draft")
        add_weight_noise(out[fam], 0.1, seed=7)
    return out


@pytest.fixture(scope="session")
def other_tokenizer_draft(tiny_models, tiny_dir) -> Path:
    """A 1-layer llama whose tokenizer has the same size as the tiny one but a different vocabulary."""
    from transformers import AutoTokenizer

    size = len(AutoTokenizer.from_pretrained(str(tiny_models["llama"])).get_vocab())
    d = build_model("llama", tiny_dir / "draft_other_tok", seed=2, layers=1)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / f).unlink(missing_ok=True)
    build_other_tokenizer(d, size)
    return d


def warnings_of(fn) -> list[str]:
    """The warnings the "specdecode" logger gives while fn() runs. Our own handler on that logger: caplog relies on
    propagation to the root logger, which a CLI run in the same process may have turned off."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log = logging.getLogger("specdecode")
    log.addHandler(handler)
    try:
        fn()
    finally:
        log.removeHandler(handler)
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]
