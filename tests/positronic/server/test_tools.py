"""Tool calls (server/tools.py): OpenAI's tools and tool_choice through the openai client, in
the Hermes convention: a required or named call held to the function's schema, whole and
streamed; a session that reads the call back and the tool's answer; refusals by name."""

import json

import pytest

from positronic.server.schemas import ChatBody
from positronic.server.hermes import call_text
from positronic.server.tools import Tools

pytest.importorskip("llguidance")

MODEL = "random:tiny"
# short: random:tiny reads ~1 token a character and has 512 positions, the tools' description included
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                   "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "clock", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                    "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather?"}]


def test_a_required_call_keeps_to_its_function_s_schema(live):
    client = live.client()
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                           max_tokens=120)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call, = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city"} and len(arguments["city"]) <= 8
    else:
        assert call.function.name == "clock" and arguments == {"zone": arguments["zone"]} and arguments["zone"] in (
            "UTC", "CET")
    named = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "clock"}},
                                           temperature=1.0, seed=2)
    call, = named.choices[0].message.tool_calls
    assert call.function.name == "clock" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    assert call.id.startswith("call_") and call.type == "function"


def test_a_streamed_call_is_the_whole_one(live):
    fields = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120)
    whole = live.client().chat.completions.create(**fields).choices[0]
    chunks = [chunk for chunk in live.client().chat.completions.create(stream=True, **fields) if chunk.choices]
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_session_reads_its_call_and_the_tool_s_answer_back(live):
    """The client sends the call back as it got it, then the tool's answer: the session takes
    them as its history and reads the answer as a user turn; a call sent back altered is not
    the session's history (409)."""
    client = live.client()
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=120, user="tools-1")
    call = first.choices[0].message
    answer = {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "sunny"}
    history = ASK + [call.model_dump(exclude_none=True)]
    second = client.chat.completions.create(model=MODEL, messages=history + [answer], tools=[WEATHER], max_tokens=4,
                                            user="tools-1")
    assert second.usage.prompt_tokens >= len(live.server.lm.encode("<tool_response>\nsunny\n</tool_response>"))
    assert second.choices[0].message.content is not None
    altered = json.loads(json.dumps(history))
    altered[1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "elsewhere"})
    refused = live.post("/v1/chat/completions", {"model": MODEL, "messages": altered + [answer], "max_tokens": 4,
                                                 "user": "tools-1", "tools": [WEATHER]})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "history_mismatch"


def test_tokenize_reads_a_tool_exchange_as_a_fresh_chat_does(live):
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    counted = live.post("/tokenize", {"messages": messages}).json()["count"]
    chat = live.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2}).json()
    assert counted == chat["usage"]["prompt_tokens"]


def test_a_fresh_conversation_with_a_tool_exchange_is_read(live):
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    response = live.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 3,
                                                  "tools": [WEATHER]})
    assert response.status_code == 200, response.text
    plain = live.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 3,
                                               "tool_choice": "none", "tools": [WEATHER]}).json()
    # "none": the tools are not described (their signatures are what the first one read more)
    assert response.json()["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]}, "messages.0.tool_call_id"),
])
def test_tool_fields_that_cannot_be_used_are_refused_by_name(live, fields, param):
    response = live.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 3, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_an_auto_reply_is_read_for_calls_to_offered_functions_only():
    tools = Tools.of(ChatBody.model_validate({"model": MODEL, "messages": ASK, "tools": [WEATHER, CLOCK]}))
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "clock", "arguments": {"zone": "UTC"}}\n</tool_call>'
    content, calls = tools.calls(text)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather", "clock"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert tools.calls('{"name": "clock", "arguments": {"zone": "CET"}}')[1][0]["function"]["name"] == "clock"
    assert tools.calls('<tool_call>{"name": "rm", "arguments": {}}</tool_call>') is None  # not offered
    assert tools.calls("It is sunny.") is None and tools.calls("<tool_call>{broken</tool_call>") is None
    assert tools.grammar() is None  # auto: the model chooses
    # the text a call is read back as is the same however its arguments were spelt
    assert call_text([("clock", '{"zone":"UTC"}')]) == call_text([("clock", {"zone": "UTC"})])


def test_a_streamed_reply_that_may_call_tools_sends_its_text_until_a_call_may_begin():
    from positronic.server.tools import CallScanner

    scanner = CallScanner()
    assert [scanner.push(p) for p in ["Let me ", "check. <to", "ol_call>\n{", '"name"']] == ["Let me ", "check. ", "", ""]
    assert scanner.sent == "Let me check. " and scanner.flush().startswith("<tool_call>\n{")
    scanner = CallScanner()
    assert [scanner.push(p) for p in [" ", "{", '"a": 1}']] == [" ", "", ""] and scanner.flush() == '{"a": 1}'
    scanner = CallScanner()
    assert [scanner.push(p) for p in ["a <", "b> c"]] == ["a ", "<b> c"]  # not the tag after all


def test_an_auto_reply_streamed_is_the_whole_one(live):
    """tool_choice auto (the default with tools): the model answers in text here, streamed as it
    comes, and the streamed text is the whole reply's."""
    fields = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=12, temperature=0.9, seed=6,
                  extra_body={"ignore_eos": True})
    whole = live.client().chat.completions.create(**fields).choices[0]
    chunks = [chunk.choices[0] for chunk in live.client().chat.completions.create(stream=True, **fields)
              if chunk.choices]
    assert whole.message.tool_calls is None and whole.finish_reason == "length"
    assert "".join(c.delta.content or "" for c in chunks) == whole.message.content
    assert sum(bool(c.delta.content) for c in chunks) > 2  # sent piece by piece, not held to the end
