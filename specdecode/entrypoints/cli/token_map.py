"""``specdecode token-map``: token frequencies of a corpus, for a truncated draft head (--draft-vocab-size)."""
from __future__ import annotations

import sys
from pathlib import Path

from specdecode.entrypoints.cli._shared import CLIError, Formatter, resolve_user_path
from specdecode.parsers import int_at_least


def add_parser(sub) -> None:
    t = sub.add_parser("token-map", formatter_class=Formatter,
                       help="rank tokens by frequency for a truncated draft head",
                       description="Count how often each token occurs in a corpus (in a ShareGPT file, the model's "
                                   "replies; in other datasets, the prompts) and write the ids, most frequent first, "
                                   "with a fingerprint of the tokenizer. Pass the file to --token-map with "
                                   "--draft-vocab-size N to keep the N most frequent in the draft's LM head.",
                       epilog="example:\n  specdecode token-map --dataset ShareGPT_V3_unfiltered_cleaned_split.json "
                              "-m draft.gguf -o qwen_tokens.json.gz")
    t.add_argument("--dataset", required=True, metavar="PATH", help="ShareGPT JSON, JSONL or text (as for bench)")
    t.add_argument("-m", "--model", default=None,
                   help="the model whose tokenizer to count with (default: the built-in target)")
    t.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="where to write the map (gzipped if it ends in .gz)")
    t.add_argument("--top", type=int_at_least(256), default=None, metavar="N",
                   help="write only the N most frequent ids (default: every id that occurs)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=run)


def run(args) -> int:
    from tqdm import tqdm

    from specdecode.bench.datasets import corpus_texts
    from specdecode.models.resolve import resolve_model
    from specdecode.speculative.draft_vocab import token_frequencies, write_token_map
    from specdecode.tokenizer import load_tokenizer

    out = Path(args.output).expanduser()
    if out.is_dir():
        raise CLIError(f"--output {args.output} is a directory; pass a file name")
    path = resolve_model(resolve_user_path(args.model, "target") if args.model else None, "target")
    tokenizer = load_tokenizer(path, path.suffix == ".gguf")
    texts = corpus_texts(args.dataset)
    if not texts:
        raise CLIError(f"{args.dataset} holds no text to count")
    progress = tqdm(texts, desc="counting tokens", unit="text", file=sys.stderr, disable=args.no_progress)
    counts = token_frequencies(tokenizer, progress, len(tokenizer))
    n = write_token_map(out, tokenizer, counts, source=Path(args.dataset).name, top=args.top)
    print(f"wrote {out}: {n} token ids seen in {int(counts.sum())} tokens of {len(texts)} texts, most frequent first",
          file=sys.stderr)
    return 0
