"""Many concurrent streaming chat completions from the real `openai` Python client (its asyncio
client, one connection per stream) against a real `llms serve --http` over TCP; run by
tests/tests/http.rs with the pinned client.

    python openai_load.py warm     # one completion per key, one after the other
    python openai_load.py load     # every client at once, each TURNS turns of one conversation

Environment: LLMS_TCP (http://127.0.0.1:PORT/v1), LLMS_MODEL, LLMS_LOAD_KEYS (a JSON object:
app name -> [key, clients]), LLMS_LOAD_TURNS, LLMS_LOAD_TOKENS (tokens each answer streams).
Prints one JSON object: every stream's app, client, turn, whether it completed (a finish reason,
the usage chunk, as many content tokens as asked), and the order streams completed in.
"""

import asyncio
import json
import os
import sys
import time

import openai

TCP = os.environ["LLMS_TCP"]
MODEL = os.environ["LLMS_MODEL"]
KEYS = json.loads(os.environ["LLMS_LOAD_KEYS"])
TURNS = int(os.environ.get("LLMS_LOAD_TURNS", "2"))
TOKENS = int(os.environ.get("LLMS_LOAD_TOKENS", "4"))


def client(key):
    # No retries: a 429 or a dropped stream must show, not be papered over.
    return openai.AsyncOpenAI(base_url=TCP, api_key=key, max_retries=0, timeout=600)


async def stream(c, messages):
    """One streamed completion: (its text, what was wrong with it or None)."""
    s = await c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    async for chunk in s:
        if chunk.choices:
            choice = chunk.choices[0]
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    if finish is None:
        return text, "no finish reason"
    if usage is None:
        return text, "no usage chunk"
    if finish == "length" and usage.completion_tokens != TOKENS:
        return text, f"{usage.completion_tokens} tokens, not {TOKENS}"
    return text, None


async def one_client(app, key, n, done):
    c = client(key)
    messages = []
    out = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Client {n}, turn {turn}: name a colour."})
        t0 = time.monotonic()
        try:
            text, wrong = await stream(c, messages)
        except Exception as e:  # noqa: BLE001 - every failure is reported, with its kind
            text, wrong = "", f"{type(e).__name__}: {e}"
        seconds = time.monotonic() - t0
        done.append(app)
        out.append(
            {
                "app": app,
                "client": n,
                "turn": turn,
                "ok": wrong is None,
                "wrong": wrong,
                "seconds": seconds,
            }
        )
        if wrong is not None:
            break
        messages.append({"role": "assistant", "content": text})
    await c.close()
    return out


async def load():
    done = []
    tasks = [
        one_client(app, key, n, done)
        for app, (key, clients) in KEYS.items()
        for n in range(clients)
    ]
    t0 = time.monotonic()
    results = await asyncio.gather(*tasks)
    return {
        "streams": [s for r in results for s in r],
        "order": done,
        "seconds": time.monotonic() - t0,
    }


async def warm():
    # The first request of each key reads its app's chat contexts; made here, one at a time, so
    # that the load phase measures the queue only.
    done = []
    for app, (key, _) in KEYS.items():
        r = await one_client(app, key, 0, done)
        assert all(s["ok"] for s in r), r
    return {"streams": [], "order": done, "seconds": 0}


def main():
    phase = sys.argv[1]
    result = asyncio.run({"warm": warm, "load": load}[phase]())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
