"""Structured output: a reply held to a JSON schema, any JSON object, a GBNF grammar, a regular
expression or a choice, by OpenAI's, llama-server's and vLLM's fields, whole and streamed, one
request alone or many at once; a grammar that cannot be used is refused by name."""

import concurrent.futures
import json
import re

import pytest
from pydantic import BaseModel, Field

pytest.importorskip("llguidance")

MODEL = "random:tiny"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


class Person(BaseModel):
    name: str = Field(max_length=8)  # bounded: a random model writes a string or a number until it is cut
    age: int = Field(ge=0, le=99)


def chat(live, fields, text="Who are you?", max_tokens=120):
    return live.post("/v1/chat/completions", {"model": MODEL, "max_tokens": max_tokens, **fields,
                                               "messages": [{"role": "user", "content": text}]})


def test_the_openai_client_gets_json_its_schema_accepts(live):
    """response_format json_schema and json_object through the client; the client's own
    `parse` (a pydantic model as the schema, strict) reads the reply back into the model."""
    client = live.client()
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name and age?"}], max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = reply.choices[0]
    value = json.loads(choice.message.content)
    assert set(value) == {"name", "age"} and 0 <= value["age"] <= 120 and len(value["name"]) <= 10
    assert choice.finish_reason == "stop"
    anything = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON?"}],
                                              max_tokens=200, temperature=1.0, seed=4,
                                              response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":  # a random model may write past max_tokens
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:
        assert anything.choices[0].message.content.startswith("{")
    parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=300,
                                           response_format=Person)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 99 and len(person.name) <= 8


def test_llama_server_and_vllm_fields_hold_the_reply(live):
    grammar = 'root ::= ("red" | "green" | "blue") " " [0-9] [0-9]'
    text = live.post("/v1/completions", {"model": MODEL, "prompt": "Colour:", "max_tokens": 20, "grammar": grammar,
                                         "temperature": 1.0, "seed": 1}).json()["choices"][0]["text"]
    assert re.fullmatch(r"(red|green|blue) [0-9]{2}", text), text
    got = live.post("/v1/completions", {"model": MODEL, "prompt": "Pick:", "max_tokens": 20,
                                        "guided_choice": ["alpha one", "beta", "gamma"]}).json()["choices"][0]
    assert got["text"] in ("alpha one", "beta", "gamma") and got["finish_reason"] == "stop"
    got = live.post("/v1/completions", {"model": MODEL, "prompt": "Code:", "max_tokens": 20,
                                        "structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}}).json()["choices"][0]
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", got["text"]), got
    value = json.loads(chat(live, {"json_schema": PERSON}).json()["choices"][0]["message"]["content"])
    assert set(value) == {"name", "age"}
    value = json.loads(chat(live, {"guided_json": json.dumps(PERSON)}).json()["choices"][0]["message"]["content"])
    assert set(value) == {"name", "age"}
    lark = 'start: "x" NUM\nNUM: /[0-9]{3}/'
    got = live.post("/v1/completions", {"model": MODEL, "prompt": "L:", "max_tokens": 20,
                                        "guided_grammar": lark}).json()["choices"][0]["text"]
    assert re.fullmatch(r"x[0-9]{3}", got), got


def test_a_streamed_constrained_reply_is_the_whole_one(live):
    fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
              "temperature": 0.8, "seed": 9}
    whole = chat(live, fields).json()["choices"][0]["message"]["content"]
    pieces = [c.choices[0].delta.content or "" for c in live.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Who are you?"}], max_tokens=120, stream=True,
        extra_body=fields) if c.choices]
    assert "".join(pieces) == whole and set(json.loads(whole)) == {"name", "age"}


def test_constrained_replies_side_by_side_equal_their_replies_alone(live):
    """Six requests at once (greedy and seeded, five grammars and one free reply) share the
    worker's engine rounds: each reply is the one it gets alone."""
    requests = [({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}, "a"),
                ({"grammar": 'root ::= [a-z]+ "!"', "temperature": 1.0, "seed": 3}, "b"),
                ({"guided_regex": "[0-9]{1,6}", "temperature": 0.7, "seed": 5}, "c"),
                ({"response_format": {"type": "json_object"}, "temperature": 1.0, "seed": 7}, "d"),
                ({}, "e"), ({"guided_choice": ["yes", "no"]}, "f")]

    def ask(fields, text):
        body = chat(live, fields, text, max_tokens=40).json()
        return body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]

    alone = [ask(fields, text) for fields, text in requests]
    rounds = live.server.worker.engine_rounds
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: ask(*r), requests))
    assert together == alone
    assert live.server.worker.engine_rounds > rounds  # the replies ticked as rounds of Core v4's engine
    assert re.fullmatch(r"[a-z]+!", alone[1][0]) and re.fullmatch(r"[0-9]{1,6}", alone[2][0])


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs its json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format", "JSON schema cannot be used"),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"grammar": "root ::= undefined"}, "grammar", "Rule 'undefined' not found"),
    ({"grammar": "root ::= [a-z", "guided_regex": "x"}, "guided_regex", "both constrain the reply"),
    ({"guided_regex": "a("}, "guided_regex", "regular expression cannot be used"),
    ({"guided_choice": []}, "guided_choice", ""),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "give one of"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "json_schema", ""),
])
def test_a_grammar_that_cannot_be_used_is_refused_by_name_and_changes_nothing(live, fields, param, message):
    before = live.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 3, "user": "structured-refusal",
                                                "messages": [{"role": "user", "content": "hi"}]}).json()
    tick = before["positronic"]["tick"]
    response = live.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 3, "user": "structured-refusal",
                                                  "messages": [{"role": "user", "content": "hi"},
                                                               before["choices"][0]["message"],
                                                               {"role": "user", "content": "again"}], **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    after = live.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 3, "user": "structured-refusal",
                                               "messages": [{"role": "user", "content": "hi"},
                                                            before["choices"][0]["message"],
                                                            {"role": "user", "content": "again"}]}).json()
    assert after["positronic"]["tick"] > tick  # the session took the same turn afterwards, as if never refused
