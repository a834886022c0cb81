"""k3_jinja.py — the K3 chat template rendered by Python jinja2 the way HF transformers does, and
the request normalisation the official encoder / server performs before it (spec/K3-CHAT.md §1.2,
§5.1), written independently of the C code. Shared by vs_jinja.py and request_e2e.py.

Oracle: tests/data/fixtures/chat/Kimi-K3.llama.cpp-pr26185.jinja (a hand port of Moonshot's official
encoding_k3.py, byte-identical to it on the features covered, spec/K3-CHAT.md §0) in a sandboxed
environment with trim_blocks, lstrip_blocks, loopcontrols, HF-style `tojson`, `raise_exception`,
`strftime_now`. Importing it needs jinja2 (the callers skip with exit 77 without it).
"""
import copy
import json
import os

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

SHARED = os.environ.get("K3_TESTDATA", os.path.join(os.path.dirname(__file__), "..", "data"))
TPL_PR = os.path.join(SHARED, "fixtures/chat/Kimi-K3.llama.cpp-pr26185.jinja")
TPL_GG = os.path.join(SHARED, "fixtures/chat/Kimi-K3.ggml-org-181a4a8f.jinja")
MARKERS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]


class TemplateError(Exception):
    pass


def raise_exception(msg):
    raise TemplateError(msg)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' chat-template tojson
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def make_template(src):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: "1970-01-01"
    return env.from_string(src)


SRC_PR = open(TPL_PR, encoding="utf-8").read()
T_PR = make_template(SRC_PR)
T_GG = make_template(open(TPL_GG, encoding="utf-8").read())
# The official key order (D1): the same template with json_sorted -> Python sort_keys.
SRC_OFFICIAL = (SRC_PR.replace("{{- json_sorted(tool_list) -}}",
                               "{{- tool_list|tojson(sort_keys=true, separators=(',', ':')) -}}")
                .replace("' + json_sorted(state.response_schema) + '",
                         "' + state.response_schema|tojson(sort_keys=true, separators=(',', ':')) + '"))
assert SRC_OFFICIAL.count("sort_keys=true") == 2, "template changed: update the D1 patch"
T_OFFICIAL = make_template(SRC_OFFICIAL)


def normalise(req, parse_args=True, map_developer=True):
    """The official encoder's / server's pre-normalisation, as the spec states it."""
    req = copy.deepcopy(req)
    ctk = req.get("chat_template_kwargs") or {}
    thinking = next((v for v in (ctk.get("thinking"), ctk.get("enable_thinking"),
                                 req.get("thinking")) if v is not None), True)
    if req.get("reasoning_effort") == "none":
        thinking = False
    effort = next((v for v in (ctk.get("thinking_effort"), req.get("thinking_effort"),
                               req.get("reasoning_effort")) if v is not None), "max")
    msgs = []
    for m in req.get("messages", []):
        m = copy.deepcopy(m)
        if map_developer and isinstance(m, dict) and m.get("role") == "developer":
            m["role"] = "system"
        if parse_args and isinstance(m, dict) and m.get("tool_calls"):
            for tc in m["tool_calls"]:
                fn = tc["function"] if isinstance(tc.get("function"), dict) else tc
                a = fn.get("arguments")
                if a is None or (isinstance(a, str) and not a.strip()):
                    fn["arguments"] = {}
                elif isinstance(a, str):
                    try:
                        v = json.loads(a)
                    except ValueError:
                        fn["_xtml_json_block"] = a
                        continue
                    if not isinstance(v, dict):
                        raise TemplateError("arguments parse to a non-object")
                    fn["arguments"] = v
        msgs.append(m)
    agp = req.get("add_generation_prompt")  # vLLM's key; null or absent = the default, true
    kw = {"messages": msgs, "thinking": thinking, "thinking_effort": effort,
          "add_generation_prompt": True if agp is None else agp}
    for k in ("tools", "tool_choice", "response_format"):
        if k in req:
            kw[k] = req[k]
    return kw


def jinja_render(req, tpl=T_PR, **nk):
    return tpl.render(**normalise(req, **nk))
