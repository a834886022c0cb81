"""responses_test.py — OpenAI's Responses API (`POST /v1/responses`), `GET /v1/models/{id}` and
`GET /ping` of `k3 serve`, with the official openai SDK (owner: serve; issue 47).

Run by ctest through pytest (tests/serve/tests.cmake):  python3 -m pytest responses_test.py -k r1x1
Groups: r1x1 (one rank) and r2x2 (2 x 2 under mpirun). Each checks:
  * responses.create with text input and instructions: the output text equals the chat endpoint's
    content for the same conversation (greedy), status "incomplete" / reason max_output_tokens at
    the limit, the reasoning item carries the chat's reasoning_content, usage equals the chat's;
  * responses.stream: the typed events in order (response.created first, response.completed
    last, every delta inside an item opened by response.output_item.added) and the final response
    equal to the non-streamed one for the same seed;
  * a tool round trip: a forced function call (its arguments validate against the tool's schema),
    then its function_call + function_call_output items sent back as input;
  * text.format json_schema: the output text validates against the schema;
  * models.retrieve, /ping, the refusals (previous_response_id, an item type, a 401 without key).
A random model seldom closes a string; a logit_bias on `"` and `<|close|>` stands in for a trained
model's habit, as in tests/grammar/test_structured.py (it cannot unmask a token).
"""
import json
import os
import sys

import jsonschema
import openai
import pytest
import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_test import KEY, Server, model_dir  # noqa: E402,F401 (model_dir: a fixture)

NAME = "k3-tiny"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                          "days": {"type": "integer"}},
                         "required": ["city", "days"], "additionalProperties": False}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
OFF = {"effort": "none"}  # thinking off: a random model would think until max_output_tokens


@pytest.fixture(scope="module", params=["r1x1", "r2x2"])
def srv(request, model_dir):
    pp, ep = (1, 1) if request.param == "r1x1" else (2, 2)
    s = Server(model_dir, pp, ep, extra=["--api-key", KEY, "--deterministic", "--max-seqs", "4",
                                         "--max-ctx", "4096", "--served-model-name", NAME])
    yield s
    assert s.stop() == 0, s.text()[-2000:]


@pytest.fixture(scope="module")
def bias(srv, model_dir):
    ids = requests.post(srv.url + "/tokenize", json={"prompt": '"'}, timeout=30).json()["tokens"]
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        added = json.load(f)["added_tokens_decoder"]
    ids += [int(k) for k, v in added.items() if v["content"] == "<|close|>"]
    assert len(ids) == 2
    return {str(i): 6 for i in ids}


def test_text_equals_chat(srv):
    c = srv.client()
    r = c.responses.create(model=NAME, instructions="Be terse.", input="Name three colours.",
                           max_output_tokens=12, temperature=0)
    chat = c.chat.completions.create(
        model=NAME, messages=[{"role": "system", "content": "Be terse."},
                              {"role": "user", "content": "Name three colours."}],
        max_tokens=12, temperature=0)
    m = chat.choices[0].message
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.output_text == m.content
    reasoning = [o for o in r.output if o.type == "reasoning"]
    assert reasoning and reasoning[0].content[0].text == m.reasoning_content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert chat.choices[0].finish_reason == "length"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens == 12
    assert r.instructions == "Be terse." and r.max_output_tokens == 12
    # input as message items (content parts, a developer message) renders the same prompt
    r2 = c.responses.create(model=NAME, input=[
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name three colours."}]}],
        max_output_tokens=12, temperature=0)
    assert r2.output_text == r.output_text and r2.usage.input_tokens == r.usage.input_tokens


def check_events(events):
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[1] == "response.in_progress"
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    open_items = set()
    for e in events:
        if e.type == "response.output_item.added":
            assert e.output_index not in open_items
            open_items.add(e.output_index)
        elif e.type == "response.output_item.done":
            open_items.remove(e.output_index)
        elif e.type.endswith(".delta"):
            assert e.output_index in open_items
    assert not open_items
    return types


def test_stream_equals_create(srv):
    c = srv.client()
    kw = dict(model=NAME, input="Tell me a story.", max_output_tokens=20, temperature=0.9, top_p=0.95,
              extra_body={"seed": 77})
    full = c.responses.create(**kw)
    with c.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    types = check_events(events)
    assert "response.reasoning_text.delta" in types
    assert final.output_text == full.output_text
    assert [o.type for o in final.output] == [o.type for o in full.output]
    assert [o.id for o in final.output] != [] and final.usage.output_tokens == full.usage.output_tokens
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == [o for o in full.output if o.type == "reasoning"][0].content[0].text
    # thinking off: the answer's text deltas put together are the final text
    kw.update(reasoning=OFF)
    full = c.responses.create(**kw)
    with c.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    types = check_events(events)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert full.output_text and text == full.output_text == final.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text


def test_tool_round_trip(srv, bias):
    c = srv.client()
    kw = dict(model=NAME, input="What is the weather in Paris?", tools=TOOLS,
              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=2000,
              reasoning=OFF, extra_body={"logit_bias": bias, "seed": 3})
    r = c.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.output
    fc = calls[0]
    assert fc.name == "get_weather" and fc.call_id and fc.status == "completed"
    jsonschema.validate(json.loads(fc.arguments), TOOLS[0]["parameters"])
    with c.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    check_events(events)
    sc = [o for o in final.output if o.type == "function_call"]
    assert len(sc) == 1 and sc[0].arguments == fc.arguments and sc[0].call_id == fc.call_id
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == fc.arguments
    # the second turn: the call and its output as input items
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
             {"type": "function_call_output", "call_id": fc.call_id, "output": json.dumps({"temp_c": 21})}]
    r2 = c.responses.create(model=NAME, input=items, tools=TOOLS, max_output_tokens=8, reasoning=OFF,
                            temperature=0)
    assert r2.usage.input_tokens > r.usage.input_tokens
    assert r2.output and r2.status in ("completed", "incomplete")
    # the same turn as chat messages gives the same prompt
    chat = c.chat.completions.create(
        model=NAME, max_tokens=8, temperature=0, reasoning_effort="none",
        tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}],
        messages=[items[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": fc.call_id, "type": "function", "function": {"name": fc.name, "arguments": fc.arguments}}]},
            {"role": "tool", "tool_call_id": fc.call_id, "content": json.dumps({"temp_c": 21})}])
    assert chat.usage.prompt_tokens == r2.usage.input_tokens
    assert chat.choices[0].message.content == r2.output_text


def test_structured_text_format(srv, bias):
    c = srv.client()
    for seed in range(3):
        r = c.responses.create(model=NAME, input="A person as JSON.", max_output_tokens=2000, reasoning=OFF,
                               text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA,
                                                "strict": True}},
                               extra_body={"logit_bias": bias, "seed": seed})
        assert r.status == "completed", r.output_text[-200:]
        jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_models_ping_refusals(srv):
    c = srv.client()
    m = c.models.retrieve(NAME)
    assert m.id == NAME and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")
    assert requests.get(srv.url + "/ping", timeout=10).status_code == 200
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        c.responses.create(model=NAME, input="x", previous_response_id="resp_0")
    with pytest.raises(openai.BadRequestError, match="item_reference"):
        c.responses.create(model=NAME, input=[{"type": "item_reference", "id": "x"}])
    with pytest.raises(openai.BadRequestError, match="function tools"):
        c.responses.create(model=NAME, input="x", tools=[{"type": "web_search"}])
    r = requests.post(srv.url + "/v1/responses", json={"model": NAME, "input": "x"}, timeout=10)
    assert r.status_code == 401
    r = requests.get(srv.url + "/v1/models/" + NAME, timeout=10)
    assert r.status_code == 401


def test_cut_tool_call_stream_equals_nonstream(srv, bias):
    """A forced tool call cut at max_tokens: the stream's deltas carry the partial call, and so
    does the whole response (vLLM's way): tool_calls holds it with the arguments as far as they
    came, finish_reason "length"; the Responses API's function_call item ends "incomplete"."""
    import serve_test
    c = srv.client()
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    # the envelope and the call's header take some tokens: the first limit that cuts inside the call
    for cut_at in (60, 70, 80, 100, 120):
        kw = dict(model=NAME, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=chat_tools,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=cut_at,
                  reasoning_effort="none", seed=11)
        msg, _, finish, _ = serve_test.collect_stream(c.chat.completions.create(stream=True, **kw))
        streamed = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
        if finish == "length" and streamed:
            break
    assert finish == "length" and len(streamed) == 1 and streamed[0]["name"] == "get_weather"
    full = c.chat.completions.create(**kw)
    ch = full.choices[0]
    assert ch.finish_reason == "length"
    got = [(t.id, t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
    assert got == [(s["id"], s["name"], s["arguments"]) for s in streamed]
    assert (ch.message.content or "") == msg["content"]
    # the Responses API: the same call, its item "incomplete", in both forms
    rkw = dict(model=NAME, input=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
               max_output_tokens=cut_at, tool_choice={"type": "function", "name": "get_weather"},
               reasoning=OFF, extra_body={"seed": 11})
    r = c.responses.create(**rkw)
    with c.responses.stream(**rkw) as s:
        events = list(s)
        final = s.get_final_response()
    check_events(events)
    for resp in (r, final):
        calls = [o for o in resp.output if o.type == "function_call"]
        assert resp.status == "incomplete" and [o.type for o in resp.output] == ["function_call"]
        assert calls[0].status == "incomplete" and calls[0].arguments == streamed[0]["arguments"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == streamed[0]["arguments"]
