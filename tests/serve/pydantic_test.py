"""pydantic_test.py — JSON Schema as pydantic writes it, end to end (owner: serve; issue 47).

Run by ctest through pytest (tests/serve/tests.cmake):  python3 -m pytest pydantic_test.py -k p1x1
A pydantic model with Field(ge=, le=, gt=, lt=, min_length=, max_length=), a tuple field, a list
with min/max length, a date and a uuid: `client.chat.completions.parse()` (the openai SDK's strict
schema of the model: minimum, maximum, exclusiveMinimum, exclusiveMaximum, minLength, maxLength,
prefixItems, minItems, maxItems, format) returns a valid instance with thinking off on 20 seeds
of the tiny random model: the grammar alone keeps the numbers in their bounds and the strings in
their lengths. A logit_bias on `"` and `<|close|>` stands in for a trained model's habit of
closing strings (as tests/grammar/test_structured.py; it cannot unmask a token). Then the
refusals: uniqueItems true, a multipleOf past 1000 and empty bounds get a 400 naming them.
"""
import datetime
import json
import os
import sys
import uuid

import openai
import pytest
import requests
from pydantic import BaseModel, Field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_test import KEY, Server, model_dir  # noqa: E402,F401 (model_dir: a fixture)

NAME = "k3-tiny"


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=12)
    age: int = Field(ge=0, le=120)
    score: float = Field(gt=0, lt=1)
    floor: int = Field(gt=-40, le=-3, multiple_of=3)
    tags: list[str] = Field(min_length=1, max_length=3)
    point: tuple[int, str]
    born: datetime.date
    id: uuid.UUID


@pytest.fixture(scope="module", params=["p1x1"])
def srv(request, model_dir):
    s = Server(model_dir, 1, 1, extra=["--api-key", KEY, "--max-seqs", "4", "--max-ctx", "4096",
                                       "--served-model-name", NAME])
    yield s
    assert s.stop() == 0, s.text()[-2000:]


def test_parse_pydantic_20_seeds(srv, model_dir):
    ids = requests.post(srv.url + "/tokenize", json={"prompt": '"'}, timeout=30).json()["tokens"]
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        added = json.load(f)["added_tokens_decoder"]
    ids += [int(k) for k, v in added.items() if v["content"] == "<|close|>"]
    bias = {str(i): 6 for i in ids}
    c = srv.client(timeout=300)
    lengths = []
    for seed in range(20):
        r = c.chat.completions.parse(
            model=NAME, messages=[{"role": "user", "content": "A person, please."}],
            response_format=Person, max_tokens=3000, seed=seed, logit_bias=bias,
            reasoning_effort="none")
        p = r.choices[0].message.parsed
        assert isinstance(p, Person), (seed, r.choices[0].message.content)
        # pydantic validated it; the bounds, once more, explicitly
        assert 0 <= p.age <= 120 and 0 < p.score < 1 and 1 <= len(p.name) <= 12
        assert -40 < p.floor <= -3 and p.floor % 3 == 0 and 1 <= len(p.tags) <= 3
        lengths.append(r.usage.completion_tokens)
    print("20 parsed instances, completion tokens %s" % lengths)


def test_refusals(srv):
    c = srv.client()
    for schema, word in (({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                          "uniqueItems"),
                         ({"type": "number", "multipleOf": 12345}, "multipleOf"),
                         ({"type": "integer", "minimum": 5, "maximum": 4}, "bounds")):
        with pytest.raises(openai.BadRequestError, match=word) as e:
            c.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "s", "schema": schema}})
        assert ".c:" not in str(e.value)  # no source locations in the message
