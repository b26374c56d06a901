"""Tool calls under tool_choice "auto" with the default model, both ways: prompts that should call a tool, and
prompts whose answer must stay text (example JSON among them). Each is asked plain and streamed through the
official openai client against a running ``specdecode serve``; greedy, so the two must agree.

    specdecode serve --port 8011 &
    python benchmarks/bench_json_tool_calls.py --url http://127.0.0.1:8011/v1
"""
from __future__ import annotations

import argparse
import json
import time

import openai


def _fn(name: str, description: str, props: dict[str, str], required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in props.items()}, "required": required}}}


TOOLS = [
    _fn("get_weather", "Get the current weather in a city", {"city": "string"}, ["city"]),
    _fn("get_time", "Get the current local time in a city", {"city": "string"}, ["city"]),
    _fn("convert_currency", "Convert an amount of money from one currency to another",
        {"amount": "number", "from_currency": "string", "to_currency": "string"},
        ["amount", "from_currency", "to_currency"]),
    _fn("web_search", "Search the web", {"query": "string"}, ["query"]),
]

SHOULD_CALL = [
    ("What is the weather in Paris?", "get_weather"),
    ("Is it raining in London right now?", "get_weather"),
    ("How warm is it in Tokyo today?", "get_weather"),
    ("What time is it in New York?", "get_time"),
    ("Tell me the local time in Sydney.", "get_time"),
    ("Convert 100 US dollars to euros.", "convert_currency"),
    ("How many Japanese yen is 50 British pounds?", "convert_currency"),
    ("Search the web for the latest Python release.", "web_search"),
    ("Look up who won the 2022 World Cup.", "web_search"),
    ("What's the weather like in Berlin?", "get_weather"),
]

STAY_TEXT = [
    "Show me an example JSON object with a name and an age",
    "Write a Python function that reverses a string.",
    "What is 2 + 2?",
    "Explain what JSON is in one sentence.",
    "Give me a JSON example of a weather report, with a city and a temperature.",
    "Hello! Who are you?",
    "Write a JSON schema for a person with a name and an age.",
    "What does the HTTP status 404 mean?",
    "Show an example of a function call in JSON for a tool named lookup.",
    "Translate 'good morning' into French.",
]


def ask(client: openai.OpenAI, model: str, prompt: str, stream: bool, max_tokens: int) -> tuple[list[str], str]:
    kw = dict(model=model, messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice="auto",
              temperature=0, max_tokens=max_tokens)
    if not stream:
        msg = client.chat.completions.create(**kw).choices[0].message
        return [c.function.name for c in msg.tool_calls or []], msg.content or ""
    names, text = [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            names += [c.function.name for c in choice.delta.tool_calls or [] if c.function and c.function.name]
    return names, "".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8011/v1")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--per-kind", type=int, default=len(SHOULD_CALL), help="prompts of each kind to ask")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key="unused", timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    t0 = time.time()
    rows = []
    for prompt, want in SHOULD_CALL[:args.per_kind]:
        for stream in (False, True):
            names, text = ask(client, model, prompt, stream, args.max_tokens)
            rows.append({"kind": "call", "prompt": prompt, "stream": stream, "ok": names == [want],
                         "calls": names, "text": text[:80]})
    for prompt in STAY_TEXT[:args.per_kind]:
        for stream in (False, True):
            names, text = ask(client, model, prompt, stream, args.max_tokens)
            rows.append({"kind": "text", "prompt": prompt, "stream": stream, "ok": not names and bool(text),
                         "calls": names, "text": text[:80]})
    for r in rows:
        print(json.dumps(r, ensure_ascii=False))
    for kind in ("call", "text"):
        for stream in (False, True):
            sel = [r for r in rows if r["kind"] == kind and r["stream"] == stream]
            print(f"{kind:5s} {'streamed' if stream else 'plain':8s}: {sum(r['ok'] for r in sel)}/{len(sel)}")
    print(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
