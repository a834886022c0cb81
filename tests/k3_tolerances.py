"""k3_tolerances.py — the test suite's tolerances for Python tests, read from tests/tolerances.h.

tests/tolerances.h is the one place a tolerance is defined and derived (STYLE.md §18); the C tests
include it and the Python tests read the same #define lines through this module, so no number is
written twice. Usage (from a test in tests/<area>/):

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from k3_tolerances import TOL
    bound = TOL["K3_TOL_GOLDEN_LOGITS_REL_L2"]

A value is a C floating literal or an arithmetic expression (+ - * / and parentheses) of literals
and earlier defines. An unknown name raises KeyError naming the header; a define this module cannot
evaluate raises ValueError with its line, so a tolerance never silently goes missing.
"""
import ast
import operator
import os
import re

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tolerances.h")

_DEFINE = re.compile(r"^\s*#\s*define\s+(K3_[A-Z0-9_]+)\s+(.*?)\s*(/\*.*)?$")
_FLOAT_SUFFIX = re.compile(r"(?<=[0-9.])[fFlL]\b")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _eval(node, env, where):
    if isinstance(node, ast.Expression):
        return _eval(node.body, env, where)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left, env, where), _eval(node.right, env, where))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand, env, where))
    raise ValueError(f"{where}: cannot evaluate '{ast.unparse(node)}' (literals, + - * /, and "
                     "earlier K3_ defines only)")


class _Tolerances(dict):
    def __missing__(self, name):
        raise KeyError(f"{name} is not defined in {HEADER}")


def load(path=HEADER):
    """{name: float} for every `#define K3_... value` of the header (include guard excluded)."""
    out = _Tolerances()
    with open(path, encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            m = _DEFINE.match(line)
            if not m or not m.group(2) or m.group(1).endswith("_H"):
                continue
            name, expr = m.group(1), _FLOAT_SUFFIX.sub("", m.group(2))
            where = f"{path}:{ln}: {name}"
            try:
                tree = ast.parse(expr, mode="eval")
            except SyntaxError as e:
                raise ValueError(f"{where}: not an arithmetic expression: {m.group(2)}") from e
            out[name] = _eval(tree, out, where)
    return out


TOL = load()
