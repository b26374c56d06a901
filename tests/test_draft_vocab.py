"""The truncated draft head: which ids it keeps (token maps, the shipped ranking, context tokens) and that
its drafts stay exact proposals (greedy output unchanged; the sampling chi-square test is in
test_sampling_distribution)."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.speculative.draft_vocab import (TruncatedHead, builtin_ranking, draft_vocab_ids, expand, load_token_map,
                                         ranking_fingerprint, token_frequencies, top_token, write_token_map)
from specdecode.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def run_cli(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "specdecode", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def tiny_tok(tiny_models):
    return load_tokenizer(tiny_models["llama"], False)


def test_draft_vocab_ids_follow_the_ranking_then_low_ids(tiny_tok):
    specials = set(tiny_tok.all_special_ids) | set(tiny_tok.added_tokens_decoder)
    ranking = [500, 400, 300, 7]
    keep = draft_vocab_ids(tiny_tok, {2}, 3, 512, ranking).tolist()
    assert set(keep) == {500, 400, 300, 2} | specials  # the first 3 ranked, plus EOS and the specials
    topped = draft_vocab_ids(tiny_tok, {2}, 6, 512, ranking).tolist()
    assert set(topped) == {500, 400, 300, 7, 0, 1, 2} | specials  # a short ranking is topped up from id 0
    assert set(draft_vocab_ids(tiny_tok, set(), None, 512, ranking).tolist()) == set(ranking) | specials
    assert keep == sorted(keep)


def test_token_map_formats_and_errors(tiny_tok, tmp_path):
    ids = [300, 5, 411]
    (tmp_path / "list.json").write_text(json.dumps(ids))
    assert load_token_map(tmp_path / "list.json", tiny_tok, 512) == ids
    torch.save(torch.tensor(ids), tmp_path / "map.pt")  # SGLang's format
    assert load_token_map(tmp_path / "map.pt", tiny_tok, 512) == ids
    good = {"token_ids": ids, "fingerprint": ranking_fingerprint(tiny_tok, ids)}
    (tmp_path / "fp.json.gz").write_bytes(gzip.compress(json.dumps(good).encode()))
    assert load_token_map(tmp_path / "fp.json.gz", tiny_tok, 512) == ids

    bad = {"token_ids": ids, "fingerprint": ranking_fingerprint(tiny_tok, [1, 2, 3])}
    (tmp_path / "other.json").write_text(json.dumps(bad))
    (tmp_path / "range.json").write_text(json.dumps([1, 512]))
    (tmp_path / "junk.json").write_text("not json")
    (tmp_path / "float.pt").write_bytes(b"")
    torch.save(torch.rand(3), tmp_path / "float.pt")
    for name, fragment in (("other.json", "different tokenizer"), ("range.json", "[0, 512)"),
                           ("junk.json", "Could not read"), ("float.pt", "integer tensor"),
                           ("missing.json", "does not exist")):
        with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace(")", r"\)")):
            load_token_map(tmp_path / name, tiny_tok, 512)


def test_builtin_ranking_fits_the_default_pair_only(tiny_tok):
    from specdecode.models.default_models import default_model_path

    qwen = load_tokenizer(default_model_path("draft"), True)
    ranking = builtin_ranking(qwen, 151936)
    assert ranking is not None and len(ranking) >= 32768 and len(set(ranking)) == len(ranking)
    # Frequent in chat text: the comma and " the" rank near the top.
    top = set(ranking[:50])
    assert qwen.convert_tokens_to_ids(",") in top and qwen.convert_tokens_to_ids("Ġthe") in top
    assert builtin_ranking(tiny_tok, 512) is None  # another tokenizer: no match, so the lowest ids are used


def test_context_tokens_join_the_head(tiny_models):
    """A truncated head scores its kept ids and every context token it was given with the full head's
    logits, and nothing else; the context set is bounded."""
    llm = LLM(str(tiny_models["llama"]), speculative_model=str(tiny_models["llama"]), num_speculative_tokens=2,
              speculative_draft_vocab_size=256, num_threads=1)
    proposer = llm.engine.proposer
    head, full = proposer.runner.model.lm_head, proposer.full_head
    assert isinstance(head, TruncatedHead)
    head.add_context([300, 301, 5, 300])
    assert head.context_ids == [300, 301]  # 5 is kept anyway
    x = torch.randn(2, head.sub.in_features)
    assert head.compact  # the proposer reads only the scored tokens' logits
    compact, ids = head(x), head.ids
    head.compact = False
    got, want = head(x), full(x)
    scored = torch.zeros(512, dtype=torch.bool)
    scored[head.keep] = True
    scored[[300, 301]] = True
    assert torch.isinf(got[:, ~scored]).all()
    torch.testing.assert_close(got[:, scored], want[:, scored])
    # Compact logits are the same values, in the order of ids; expanded, the vocabulary-wide row bit for bit.
    assert sorted(ids.tolist()) == scored.nonzero().flatten().tolist()
    assert torch.equal(compact, got[:, ids]) and torch.equal(expand(compact, ids, 512), got)
    for row in range(2):
        assert top_token(compact[row], ids, 512) == int(got[row].argmax())
    head.max_context_tokens = 3
    head.add_context([400, 300, 401])
    assert head.context_ids == [300, 400, 401]  # over the bound: the least recently seen token (301) goes
    torch.testing.assert_close(head(x)[:, [300, 400, 401]], want[:, [300, 400, 401]])
    assert ids.tolist()[-2:] == [300, 301]  # ids kept with earlier logits stay as they were
    head.compact = True

    # Tokens a request brings enter the head when the draft first reads them.
    head.max_context_tokens = 2048
    prompt = list(range(300, 330))
    llm.generate([{"prompt_token_ids": prompt}], GREEDY)
    assert set(prompt) <= set(head.context_ids) | set(head.keep.tolist())
    # ... and the draft's pass over the prompt is timed apart from decoding (the bench and the CLI report it).
    before = proposer.prefill_seconds
    prompt = list(range(440, 470))
    llm.generate([{"prompt_token_ids": prompt}], GREEDY)
    assert proposer.prefill_seconds > before
    assert set(prompt) <= set(head.context_ids) | set(head.keep.tolist())


def test_token_map_command_and_exact_greedy(tiny_models, tmp_path):
    """specdecode token-map counts a corpus; a draft head cut from that map keeps greedy output exact."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"word{i % 37} and more text number {i}\n" for i in range(200)))
    out = tmp_path / "map.json.gz"
    p = run_cli("token-map", "--dataset", corpus, "-m", tiny_models["llama"], "-o", out, "--no-progress")
    assert p.returncode == 0, p.stderr
    data = json.loads(gzip.decompress(out.read_bytes()))
    tok = load_tokenizer(tiny_models["llama"], False)
    counts = token_frequencies(tok, [ln for ln in corpus.read_text().splitlines()], 512)
    assert data["token_ids"][0] == int(counts.argmax()) and len(data["token_ids"]) == int((counts > 0).sum())
    assert data["fingerprint"] == ranking_fingerprint(tok, data["token_ids"])

    prompts = [{"prompt_token_ids": list(range(10 + 7 * i, 30 + 7 * i))} for i in range(3)]
    plain = LLM(str(tiny_models["llama"]), num_threads=1).generate(prompts, GREEDY)
    spec = LLM(str(tiny_models["llama"]), speculative_model=str(tiny_models["llama"]), num_speculative_tokens=3,
               speculative_token_map=str(out), speculative_draft_vocab_size=256, num_threads=1)
    head = spec.engine.proposer.runner.model.lm_head
    assert set(data["token_ids"][:256]) <= set(head.keep.tolist())
    outs = spec.generate(prompts, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == [list(o.outputs[0].token_ids) for o in plain]
    assert spec.spec_decode_metrics.num_accepted_tokens > 0


def test_write_token_map_top(tiny_tok, tmp_path):
    counts = torch.zeros(512, dtype=torch.long)
    counts[[9, 8, 7, 6]] = torch.tensor([1, 5, 3, 2])
    assert write_token_map(tmp_path / "m.json", tiny_tok, counts, "test", top=2) == 2
    assert json.loads((tmp_path / "m.json").read_text())["token_ids"] == [8, 7]
    assert write_token_map(tmp_path / "all.json", tiny_tok, counts, "test") == 4


def test_corpus_texts_take_the_replies_of_sharegpt(tmp_path):
    from specdecode.bench.datasets import corpus_texts

    conv = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"},
                               {"from": "human", "value": "  "}]},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                          {"role": "assistant", "content": "a"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(conv)[:-1])  # a cut-off download still counts its complete entries
    assert corpus_texts(str(path)) == ["hello there", "a"]
    (tmp_path / "p.txt").write_text("one\ntwo\n")
    assert corpus_texts(str(tmp_path / "p.txt")) == ["one", "two"]
