"""Request routing for the Ray Serve app: what the ingress forwards to an engine replica
(:class:`ForwardedRequest`, with the prompt text as its routing key) and :class:`PrefixAffinityRouter`, which
picks the replica. Ray Serve imports the router by its path (``ROUTERS`` in serve.py)."""
from __future__ import annotations

import collections
import dataclasses
import json
import random
from typing import Any, Iterable

# Without the extra this raises "No module named 'ray'"; `specdecode serve --ray` turns that into the install hint.
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


# ====================================================================== the forwarded request
@dataclasses.dataclass
class ForwardedRequest:
    """One HTTP request as the ingress forwards it to an engine replica.

    ``prompt`` is the routing key only (the replica parses the body itself): the prompt text, or the chat
    messages flattened in order, so a later turn of a conversation starts with the text of the earlier ones.
    Ray's own ``PrefixCacheAffinityRouter`` reads the same attribute."""
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: str | None = None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) and isinstance(p.get("text"), str) else ""
                       for p in content)
    return ""


def routing_text(path: str, body: bytes) -> str | None:
    """The prompt text a generation request carries (None for other requests and for bodies that do not parse:
    those go to the least loaded replica, which answers them as the single-process server would)."""
    return inspect_request(path, body)[0]


def inspect_request(path: str, body: bytes) -> tuple[str | None, bool]:
    """(routing text, whether the response streams)."""
    if path not in _GENERATION_PATHS or not body:
        return None, False
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None, False
    if not isinstance(req, dict):
        return None, False
    return _prompt_text(path, req), req.get("stream") is True


def _prompt_text(path: str, req: dict) -> str | None:
    if path == "/v1/completions":
        prompt = req.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]  # a batch: the first prompt decides
        if isinstance(prompt, str):
            return prompt or None
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return " ".join(map(str, prompt)) or None
        return None
    messages = req.get("messages")
    if not isinstance(messages, list):
        return None
    parts = []
    for m in messages:
        if isinstance(m, dict):
            parts.append(f"<|{m.get('role')}|>{_text_of(m.get('content'))}\n")
    return "".join(parts) or None


# ====================================================================== prefix-aware request router
class PrefixAffinityRouter(RequestRouter):
    """Sends a request to a replica that served the longest prefix of its prompt, unless that replica is busier
    than the least loaded one by more than ``imbalanced_threshold`` requests; otherwise power of two choices.

    Prompts are cut into blocks of ``block_chars`` characters; a chained hash of the blocks names each prefix,
    and a bounded LRU table maps a prefix to the replicas that served it. Lookups and inserts are in-process
    (no actor round trip on the routing path). Each ingress replica routes with its own table; with one ingress
    (the default) that is the whole picture. The preferred replicas come as the first rank and the others as a
    second, so when the preferred ones are full (``max_ongoing_requests``) Ray goes on to the rest at once."""

    def initialize_state(self, block_chars: int = 64, imbalanced_threshold: int = 4,
                         max_prefixes: int = 200_000) -> None:
        if block_chars < 1 or imbalanced_threshold < 0 or max_prefixes < 1:
            raise ValueError("PrefixAffinityRouter needs block_chars >= 1, imbalanced_threshold >= 0 and "
                             "max_prefixes >= 1.")
        self._block = int(block_chars)
        self._threshold = imbalanced_threshold
        self._max_prefixes = int(max_prefixes)
        self._owners: collections.OrderedDict[int, dict[ReplicaID, None]] = collections.OrderedDict()
        self.affinity_hits = 0  # requests sent to a prefix owner (for tests and debugging)

    def _hashes(self, text: str) -> Iterable[int]:
        h, b = 0, self._block
        for end in range(b, len(text) + 1, b):
            h = hash((h, text[end - b:end]))
            yield h

    @staticmethod
    def _key(pending_request: PendingRequest | None) -> str | None:
        if pending_request is None or not pending_request.args:
            return None
        prompt = getattr(pending_request.args[0], "prompt", None)
        return prompt if isinstance(prompt, str) and prompt else None

    def _owners_of(self, text: str, live: dict[ReplicaID, RunningReplica]) -> list[ReplicaID]:
        best: list[ReplicaID] = []
        for h in self._hashes(text):
            owners = self._owners.get(h)
            if owners is None:
                break  # prefixes nest: a longer one cannot be known when this one is not
            found = [rid for rid in owners if rid in live]
            if found:
                best = found
        return best

    def _imbalanced(self, owners: list[ReplicaID], live: dict[ReplicaID, RunningReplica]) -> bool:
        cache = self.replica_queue_len_cache
        lens = {rid: cache.get(rid) for rid in live}
        known = [v for v in lens.values() if v is not None]
        owner_lens = [lens[rid] for rid in owners if lens[rid] is not None]
        if not known or not owner_lens:
            return False
        return min(owner_lens) - min(known) > self._threshold

    @staticmethod
    def _two_choices(replicas: list[RunningReplica]) -> list[RunningReplica]:
        return random.sample(replicas, min(2, len(replicas)))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        text = self._key(pending_request)
        if text is not None:
            live = {r.replica_id: r for r in candidate_replicas}
            owners = self._owners_of(text, live)
            if owners and not self._imbalanced(owners, live):
                self.affinity_hits += 1
                rest = [r for rid, r in live.items() if rid not in owners]
                ranks = [[live[rid] for rid in owners]]
                if rest:
                    ranks.append(self._two_choices(rest))
                return ranks
        return [self._two_choices(candidate_replicas)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        text = self._key(pending_request)
        if text is None:
            return
        table = self._owners
        for h in self._hashes(text):
            owners = table.get(h)
            if owners is None:
                owners = table[h] = {}
            else:
                table.move_to_end(h)
            owners.pop(replica_id, None)
            owners[replica_id] = None  # most recent owner last
        while len(table) > self._max_prefixes:
            table.popitem(last=False)

