"""The real `openai` Python client against a real `llms serve --http` (tests/tests/http.rs runs
this file with the pinned client in a venv of its own).

    python openai_suite.py first STATE   # every check; the 10-turn conversation's end in STATE
    python openai_suite.py after STATE   # after kill -9 and a restart: the conversation goes on

Environment: LLMS_TCP (http://127.0.0.1:PORT/v1), LLMS_UNIX (the HTTP socket's path), LLMS_KEY
(a key of this uid), LLMS_OTHER_KEY (a key of another uid), LLMS_MODEL (the model's id).
Each check is a function; every failure is printed, and the exit status says whether any failed.
"""

import json
import os
import sys
import traceback

import httpx
import openai

TCP = os.environ["LLMS_TCP"]
MODEL = os.environ["LLMS_MODEL"]
# The chunk size of the daemon's KV cache: the last chunk of a context (open, or full but not yet
# sealed) is computed again on its next call, so up to this many tokens less than the whole
# context are cached.
CHUNK = 16


def tcp_client(key):
    return openai.OpenAI(base_url=TCP, api_key=key, max_retries=0, timeout=600)


def unix_client():
    transport = httpx.HTTPTransport(uds=os.environ["LLMS_UNIX"])
    return openai.OpenAI(
        base_url="http://localhost/v1",
        api_key="unused: the uid is the socket peer's",
        http_client=httpx.Client(transport=transport, timeout=600),
        max_retries=0,
    )


me = tcp_client(os.environ["LLMS_KEY"])
other = tcp_client(os.environ["LLMS_OTHER_KEY"])
local = unix_client()

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def expect_error(kind, f, says=None):
    """Runs f, which must raise the openai error `kind` (whose message contains `says`)."""
    try:
        f()
    except kind as e:
        if says is not None:
            assert says in str(e), f"{kind.__name__} without {says!r}: {e}"
        return e
    raise AssertionError(f"expected {kind.__name__}")


def chat(client, messages, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def check_models():
    ids = [m.id for m in me.models.list().data]
    assert ids == [MODEL], ids
    assert [m.id for m in local.models.list().data] == [MODEL]


def check_chat_whole_and_streamed():
    q = [{"role": "user", "content": "What is the capital of France?"}]
    whole = chat(me, q)
    text = whole.choices[0].message.content
    assert text, whole
    assert whole.choices[0].finish_reason in ("stop", "length"), whole
    u = whole.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u
    chunks = list(chat(me, q, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # Greedy decoding of the same tokens: the same answer, whole or streamed.
    assert streamed == text, (streamed, text)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason], finish
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, chunks[-1]
    assert chunks[-1].usage.completion_tokens == u.completion_tokens, chunks[-1].usage
    # Over the Unix socket, as this uid too.
    assert chat(local, q).choices[0].message.content == text


def check_chat_reuses_a_conversation_it_holds():
    q = [{"role": "user", "content": "Name a fruit."}]
    first = chat(me, q)
    said = first.choices[0].message.content
    held = first.usage.prompt_tokens + first.usage.completion_tokens
    follow = q + [{"role": "assistant", "content": said}, {"role": "user", "content": "And a vegetable?"}]
    second = chat(me, follow)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Everything the conversation held was cached but its open last chunk.
    assert held - CHUNK <= cached <= held, (held, cached, second.usage)
    assert second.usage.prompt_tokens > held, second.usage
    # The same history with another answer is another conversation: nothing cached.
    changed = q + [{"role": "assistant", "content": said + " Or two."}, {"role": "user", "content": "And a vegetable?"}]
    third = chat(me, changed)
    assert third.usage.prompt_tokens_details.cached_tokens == 0, third.usage


def check_structured_output():
    r = chat(
        me,
        [{"role": "user", "content": "Give a famous scientist as JSON."}],
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    v = json.loads(r.choices[0].message.content)
    assert set(v) == {"name", "age"} and isinstance(v["name"], str), v
    assert isinstance(v["age"], int) and 0 <= v["age"] <= 120, v


def check_tools():
    q = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    r = chat(me, q, tools=[WEATHER], tool_choice="required", max_tokens=120)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", r
    assert m.content is None and len(m.tool_calls) == 1, m
    call = m.tool_calls[0]
    assert call.function.name == "get_weather", call
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str), args
    held = r.usage.prompt_tokens + r.usage.completion_tokens
    back = q + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'},
    ]
    answer = chat(me, back, tools=[WEATHER], max_tokens=24)
    assert answer.choices[0].message.content, answer
    # The tool's result continued the context that made the call.
    assert answer.usage.prompt_tokens_details.cached_tokens >= held - CHUNK, (held, answer.usage)


def respond(client, **kw):
    kw.setdefault("max_output_tokens", 10)
    kw.setdefault("temperature", 0)
    return client.responses.create(model=MODEL, **kw)


def turn_checks(prev_id, held, prompt):
    """One more turn after response `prev_id`, whose context held `held` tokens: only the turn's
    new tokens are prefilled, the rest is cached (but the open last chunk)."""
    new = me.responses.input_tokens.count(model=MODEL, input=prompt, previous_response_id=prev_id).input_tokens
    r = respond(me, input=prompt, previous_response_id=prev_id)
    assert r.usage.input_tokens == held + new, (held, new, r.usage)
    cached = r.usage.input_tokens_details.cached_tokens
    assert held - CHUNK <= cached <= held, (held, cached)
    assert r.previous_response_id == prev_id and r.output_text is not None, r
    return r


def held(r):
    return r.usage.input_tokens + r.usage.output_tokens


def check_ten_turns(state):
    count = me.responses.input_tokens.count(model=MODEL, input="Tell me about cats.", instructions="Answer in one short sentence.")
    r = respond(me, input="Tell me about cats.", instructions="Answer in one short sentence.")
    assert r.usage.input_tokens == count.input_tokens, (count, r.usage)
    assert r.usage.input_tokens_details.cached_tokens == 0, r.usage
    first = r
    for i in range(9):
        r = turn_checks(r.id, held(r), f"Tell me one more thing, number {i + 2}.")
    # Any response of the conversation reads back from its context; the older ones moved on.
    assert me.responses.retrieve(first.id).output_text == first.output_text
    assert me.responses.retrieve(r.id).output_text == r.output_text
    expect_error(openai.ConflictError, lambda: respond(me, input="Again?", previous_response_id=first.id), "moved on")
    expect_error(openai.ConflictError, lambda: me.responses.delete(first.id), "later responses")
    with open(state, "w") as f:
        json.dump({"last": r.id, "held": held(r), "first": first.id, "first_text": first.output_text}, f)


def check_responses_store_stream_and_tools():
    r = respond(me, input="Say hello.", store=False)
    expect_error(openai.NotFoundError, lambda: me.responses.retrieve(r.id))
    events = list(respond(me, input="Say hello.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events))), kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text, (deltas, events[-1].response.output_text)
    tool = {"type": "function", **WEATHER["function"]}
    called = respond(me, input="What is the weather in Rome?", tools=[tool], tool_choice="required", max_output_tokens=120)
    call = [o for o in called.output if o.type == "function_call"]
    assert len(call) == 1 and call[0].name == "get_weather", called.output
    assert "city" in json.loads(call[0].arguments), call
    after = respond(
        me,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call[0].call_id, "output": "22C, clear"}],
        tools=[tool],
        max_output_tokens=16,
    )
    assert after.output_text is not None and after.usage.input_tokens_details.cached_tokens > 0, after.usage
    r = respond(me, input="Give a famous scientist as JSON.", max_output_tokens=60,
                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert set(json.loads(r.output_text)) == {"name", "age"}, r.output_text


def check_conversations():
    conv = me.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."},
                                         {"type": "message", "role": "assistant", "content": "Hello Ada."}])
    assert me.conversations.retrieve(conv.id).id == conv.id
    r = respond(me, input="What is my name?", conversation=conv.id)
    assert r.usage.input_tokens_details.cached_tokens > 0, r.usage
    r2 = respond(me, input="Thanks.", conversation=conv.id)
    held = r.usage.input_tokens + r.usage.output_tokens
    assert r2.usage.input_tokens_details.cached_tokens >= held - CHUNK, (held, r2.usage)
    items = list(me.conversations.items.list(conv.id, order="asc", limit=2))  # three pages
    kinds = [(i.type, i.role) for i in items]
    assert kinds == [("message", "user"), ("message", "assistant")] * 3, kinds
    assert items[0].content[0].text == "My name is Ada." and items[4].content[0].text == "Thanks.", items
    assert items[5].content[0].text == r2.output_text, (items[5], r2.output_text)
    page = me.conversations.items.list(conv.id, limit=2)  # newest first
    assert [i.id for i in page.data] == [items[5].id, items[4].id] and page.has_more, page
    expect_error(openai.NotFoundError, lambda: other.conversations.items.list(conv.id))
    expect_error(openai.NotFoundError, lambda: other.conversations.retrieve(conv.id))
    expect_error(openai.NotFoundError, lambda: respond(other, input="x", conversation=conv.id))
    expect_error(openai.ConflictError, lambda: me.responses.delete(r2.id), "conversation")
    me.conversations.delete(conv.id)
    expect_error(openai.NotFoundError, lambda: me.conversations.retrieve(conv.id))


def check_errors_and_other_uids(state):
    with open(state) as f:
        s = json.load(f)
    expect_error(openai.BadRequestError, lambda: chat(me, [{"role": "user", "content": "x"}], logprobs=True), "logprobs")
    expect_error(openai.BadRequestError, lambda: chat(me, [{"role": "user", "content": "x"}], n=2), "n=2")
    expect_error(openai.BadRequestError, lambda: chat(me, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "image_url")
    expect_error(openai.BadRequestError, lambda: respond(me, input="x", reasoning={"effort": "high"}), "reasoning")
    expect_error(openai.NotFoundError, lambda: me.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}]), "gpt-4o")
    expect_error(openai.AuthenticationError, lambda: tcp_client("llms-not-a-key").models.list())
    # Another uid's key sees none of this uid's responses.
    for rid in (s["last"], s["first"]):
        expect_error(openai.NotFoundError, lambda: other.responses.retrieve(rid))
        expect_error(openai.NotFoundError, lambda: other.responses.delete(rid))
        expect_error(openai.NotFoundError, lambda: respond(other, input="x", previous_response_id=rid))
        expect_error(openai.NotFoundError, lambda: other.responses.input_tokens.count(model=MODEL, input="x", previous_response_id=rid))


def check_after_restart(state):
    with open(state) as f:
        s = json.load(f)
    assert me.responses.retrieve(s["first"]).output_text == s["first_text"]
    # The conversation goes on after kill -9: its context came back from the store.
    r = turn_checks(s["last"], s["held"], "One last thing?")
    me.responses.delete(r.id)
    expect_error(openai.NotFoundError, lambda: me.responses.retrieve(r.id))


def main():
    phase, state = sys.argv[1], sys.argv[2]
    checks = {
        "first": [
            check_models,
            check_chat_whole_and_streamed,
            check_chat_reuses_a_conversation_it_holds,
            check_structured_output,
            check_tools,
            check_ten_turns,
            check_responses_store_stream_and_tools,
            check_conversations,
            check_errors_and_other_uids,
        ],
        "after": [check_after_restart],
    }[phase]
    failed = 0
    for c in checks:
        name = c.__name__
        try:
            if c.__code__.co_argcount:
                c(state)
            else:
                c()
            print(f"ok {name}", flush=True)
        except Exception:
            failed += 1
            print(f"FAILED {name}", flush=True)
            traceback.print_exc()
    print(f"openai {openai.__version__}: {len(checks) - failed} passed, {failed} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
