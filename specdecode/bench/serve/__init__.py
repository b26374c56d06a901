"""``specdecode bench serve``: a serving benchmark client for any OpenAI-compatible server (ours, llama-server,
vLLM), in the manner of ``vllm bench serve``.

It streams a workload to ``/v1/chat/completions`` (or ``/v1/completions``) at a fixed concurrency and/or a
Poisson request rate and reports what ``vllm bench serve`` reports. Definitions (vLLM's):

  TTFT        request sent -> first streamed chunk that carries text (a role-only or empty chunk is not a token)
  TPOT        (E2E latency - TTFT) / (output tokens - 1), per request with more than one output token
  ITL         the gaps between successive text-carrying chunks, all requests pooled. A chunk holding several
              tokens (a speculative step can emit several at once) counts as one gap, as in vLLM, so ITL
              measures what a streaming client sees and TPOT the per-token cost
  E2E         request sent -> end of the stream
  throughput  completed requests, output tokens, and input + output tokens per second of benchmark wall time
  acceptance  acceptance rate = accepted / drafted tokens; mean acceptance length = 1 + accepted / drafts

Output tokens come from the server's ``usage`` (requested with ``stream_options.include_usage``); without it,
from ``--tokenizer`` counting the streamed text; failing both, the number of text chunks (the report says which).

Multi-turn (``--multi-turn``): each conversation is replayed turn by turn; every later turn resends the whole
history, the model's own earlier answers included. ``--max-concurrency`` then counts conversations in flight
(chat users), and the request rate paces the conversation starts.

One module per part: ``workload`` (the prompts and conversations), ``client`` (one streamed request, the
server's /metrics), ``benchmark`` (the runs: concurrency limit, Poisson arrivals), ``report`` (the summary and
its text), ``cli`` (the flags); the chart is ``specdecode.bench.plots.write_serve_plot``.
"""
