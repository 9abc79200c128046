"""score_mod and mask_mod: a user's attention variant as a small expression, checked on the host and
turned into CUDA source (to be compiled into the kernels) and into NumPy (the CPU path).

The language is a subset of Python expressions that reads the same as C:

- names: ``score`` (score_mod only: the scaled score, after a built-in softcap and ALiBi), ``b``
  (the batch entry, or the sequence of a packed batch), ``h`` (the query head), ``q_idx`` and
  ``kv_idx`` (the query's and key's positions in their sequence), and the arrays of ``mod_args``,
  indexed once per dimension (``slopes[h]``, ``doc_id[b][q_idx]``) by int expressions;
- int, float and bool constants; ``+ - * /`` (``/`` always in float), ``//`` and ``%`` (floored,
  as in Python, on ints), unary ``-``, ``not``, ``and``, ``or``, one comparison at a time
  (``a < b``; chains such as ``a < b < c`` are refused: C reads them otherwise);
- functions ``where(cond, a, b)``, ``exp``, ``log``, ``tanh``, ``sqrt``, ``abs``, ``min(a, b)``,
  ``max(a, b)``, ``int(x)`` (towards zero) and ``float(x)``.

A score_mod is float-valued, a mask_mod bool-valued (True: the key is seen, with the built-in
masks). Each node has a type (int, float or bool) fixed on the host, so that the CUDA and NumPy
forms compute the same thing; the derivative of a score_mod with respect to ``score`` (for the
backward) is formed by forward-mode differentiation of the same tree.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["INDEX_NAMES", "Mod", "parse_mod"]

INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")
# name: (arity, result type or None for the operands' common type)
FUNCTIONS = {"where": (3, None), "exp": (1, "float"), "log": (1, "float"), "tanh": (1, "float"),
             "sqrt": (1, "float"), "abs": (1, None), "min": (2, None), "max": (2, None), "int": (1, "int"),
             "float": (1, "float")}
_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%"}
_COMPARE = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_CUDA_FLOAT = {"exp": "expf", "log": "logf", "tanh": "tanhf", "sqrt": "sqrtf", "abs": "fabsf", "min": "fminf",
               "max": "fmaxf"}


def _kind(dtype: np.dtype) -> str:
    """An array's element type in the language: bool, int or float."""
    if dtype == np.bool_:
        return "bool"
    if np.issubdtype(dtype, np.integer):
        return "int"
    if np.issubdtype(dtype, np.floating):
        return "float"
    raise TypeError(f"mod_args: dtype {dtype} is not bool, an integer or a float type")


@dataclass(frozen=True)
class _Node:
    """A checked node: its type, its CUDA code, its NumPy evaluator and (float nodes of a
    score_mod) the CUDA code and evaluator of its derivative with respect to ``score``."""

    type: str
    cuda: str
    numpy: Callable[[dict], Any]
    d_cuda: str = "0.f"
    d_numpy: Callable[[dict], Any] = lambda env: 0.0


@dataclass(frozen=True)
class Mod:
    """A checked score_mod or mask_mod. ``cuda``: the expression in CUDA over ``score``, ``b``,
    ``h``, ``q_idx``, ``kv_idx`` (int) and ``mod_<name>(i, ...)`` loads of each array;
    ``derivative_cuda``: d/dscore of a score_mod. ``arrays``: the names of the mod_args it reads, with
    their element types (which key its compiled variant with the text)."""

    kind: str  # "score_mod" or "mask_mod"
    text: str
    cuda: str
    derivative_cuda: str
    arrays: tuple[tuple[str, str, int], ...]  # (name, element type, dimensions)
    _numpy: Callable[[dict], Any]
    _d_numpy: Callable[[dict], Any]

    def evaluate(self, env: dict) -> np.ndarray:
        """The expression's value with NumPy: ``env`` maps ``score`` (a score_mod's), ``b``,
        ``h``, ``q_idx``, ``kv_idx`` (broadcastable arrays or ints) and each array's name to its
        NumPy array."""
        return self._numpy(env)

    def derivative(self, env: dict) -> np.ndarray:
        """d/dscore of a score_mod, as :meth:`evaluate` takes ``env``."""
        return self._d_numpy(env)

    def key(self) -> tuple:
        """What a compiled variant is cached by: the kind, the text and the arrays' types."""
        return self.kind, self.text, self.arrays


def parse_mod(kind: str, text: Any, mod_args: dict | None = None) -> Mod:
    """``text`` checked as a ``kind`` ("score_mod" or "mask_mod") over the arrays of ``mod_args``
    (name -> array; only their dtypes and dimensions are read): a TypeError or ValueError naming
    ``kind`` and what is wrong (an unknown name, a function, an operator, an index, a type)."""
    if not isinstance(text, str):
        raise TypeError(f"{kind}: expected an expression as a str, got {type(text).__name__}")
    arrays = {}
    for name, array in (mod_args or {}).items():
        if not isinstance(name, str) or not name.isidentifier() or name in INDEX_NAMES + ("score",) \
                or name in FUNCTIONS:
            raise ValueError(f"mod_args: {name!r} is not a name an expression can use (an identifier other than "
                             f"score, {', '.join(INDEX_NAMES)} and the functions)")
        arrays[name] = (_kind(np.dtype(array.dtype)), len(array.shape))
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"{kind}: {text!r} is not an expression ({error.msg})") from None
    builder = _Builder(kind, text, arrays)
    node = builder.build(tree.body)
    want = "float" if kind == "score_mod" else "bool"
    if kind == "score_mod" and node.type == "int":
        node = builder.cast(node, "float")
    if node.type != want:
        raise TypeError(f"{kind}: {text!r} is {node.type}-valued; a {kind} must be {want}-valued")
    used = tuple((name, *arrays[name]) for name in sorted(builder.used))
    return Mod(kind, text, node.cuda, node.d_cuda, used, node.numpy, node.d_numpy)


class _Builder:
    def __init__(self, kind: str, text: str, arrays: dict):
        self.kind, self.text, self.arrays = kind, text, arrays
        self.used: set[str] = set()

    def fail(self, what: str, error=ValueError):
        return error(f"{self.kind}: {what} in {self.text!r}")

    def cast(self, node: _Node, to: str) -> _Node:
        if node.type == to:
            return node
        if to == "float":
            return _Node("float", f"float({node.cuda})", lambda env, f=node.numpy: np.asarray(f(env), np.float64),
                         node.d_cuda, node.d_numpy)
        raise self.fail(f"a {node.type} where an {to} is needed", TypeError)

    def build(self, n: ast.AST) -> _Node:
        method = getattr(self, f"_{type(n).__name__}", None)
        if method is None:
            raise self.fail(f"{type(n).__name__} is not part of the language (arithmetic, comparisons, and, or, not, "
                            f"{', '.join(FUNCTIONS)})")
        return method(n)

    def _Constant(self, n: ast.Constant) -> _Node:
        value = n.value
        if isinstance(value, bool):
            return _Node("bool", "true" if value else "false", lambda env: value)
        if isinstance(value, int):
            if not -2**31 <= value < 2**31:
                raise self.fail(f"the int {value} does not fit 32 bits")
            return _Node("int", str(value), lambda env: value)
        if isinstance(value, float):
            if not np.isfinite(value):
                raise self.fail(f"the constant {value} is not finite")
            return _Node("float", f"{float(np.float32(value))!r}f", lambda env: value)
        raise self.fail(f"the constant {value!r} is not an int, float or bool", TypeError)

    def _Name(self, n: ast.Name) -> _Node:
        name = n.id
        if name == "score":
            if self.kind != "score_mod":
                raise self.fail("score is a score_mod's name; a mask_mod sees b, h, q_idx and kv_idx")
            return _Node("float", "score", lambda env: env["score"], "1.f", lambda env: 1.0)
        if name in INDEX_NAMES:
            return _Node("int", name, lambda env: env[name])
        if name in self.arrays:
            raise self.fail(f"{name} is an array of {self.arrays[name][1]} dimensions: index it, as {name}[h]")
        raise self.fail(f"unknown name {name!r} (the names are score, {', '.join(INDEX_NAMES)} and the mod_args "
                        f"{sorted(self.arrays) or 'none given'})")

    def _Subscript(self, n: ast.Subscript) -> _Node:
        indices = []
        while isinstance(n, ast.Subscript):
            if isinstance(n.slice, (ast.Slice, ast.Tuple)):
                raise self.fail("an index is one int expression per bracket, as table[h][q_idx]")
            indices.insert(0, self.build(n.slice))
            n = n.value
        if not isinstance(n, ast.Name) or n.id not in self.arrays:
            raise self.fail("only the arrays of mod_args are indexed")
        name = n.id
        element, dims = self.arrays[name]
        if len(indices) != dims:
            raise self.fail(f"{name} has {dims} dimensions, indexed {len(indices)} times")
        for index in indices:
            if index.type != "int":
                raise self.fail(f"an index of {name} is {index.type}-valued, not an int", TypeError)
        self.used.add(name)
        getters = [index.numpy for index in indices]

        def load(env, name=name, getters=getters):
            array = env[name]
            where = tuple(np.asarray(g(env)) for g in getters)
            try:
                return array[where]
            except IndexError:
                raise ValueError(f"{self.kind}: an index of {name} is outside its shape {array.shape}") from None
        return _Node(element, f"mod_{name}({', '.join(i.cuda for i in indices)})", load)

    def _BinOp(self, n: ast.BinOp) -> _Node:
        op = _BINARY.get(type(n.op))
        if op is None:
            raise self.fail(f"the operator {type(n.op).__name__} is not part of the language")
        a, b = self.build(n.left), self.build(n.right)
        for side in (a, b):
            if side.type == "bool":
                raise self.fail(f"a bool operand of {op}", TypeError)
        if op in ("//", "%"):
            if a.type != "int" or b.type != "int":
                raise self.fail(f"{op} takes ints (floored, as in Python)", TypeError)
            function = {"//": np.floor_divide, "%": np.mod}[op]
            helper = {"//": "cuflash_floordiv", "%": "cuflash_floormod"}[op]
            return _Node("int", f"{helper}({a.cuda}, {b.cuda})", lambda env: function(a.numpy(env), b.numpy(env)))
        if op == "/" or "float" in (a.type, b.type):
            a, b = self.cast(a, "float"), self.cast(b, "float")
            kind = "float"
        else:
            kind = "int"
        code = f"({a.cuda} {op} {b.cuda})"
        if op == "+":
            return _Node(kind, code, lambda env: a.numpy(env) + b.numpy(env), f"({a.d_cuda} + {b.d_cuda})",
                         lambda env: a.d_numpy(env) + b.d_numpy(env))
        if op == "-":
            return _Node(kind, code, lambda env: a.numpy(env) - b.numpy(env), f"({a.d_cuda} - {b.d_cuda})",
                         lambda env: a.d_numpy(env) - b.d_numpy(env))
        if op == "*":
            return _Node(kind, code, lambda env: a.numpy(env) * b.numpy(env),
                         f"({a.d_cuda} * {b.cuda} + {a.cuda} * {b.d_cuda})",
                         lambda env: a.d_numpy(env) * b.numpy(env) + a.numpy(env) * b.d_numpy(env))
        return _Node("float", code, lambda env: np.divide(a.numpy(env), b.numpy(env)),
                     f"(({a.d_cuda} * {b.cuda} - {a.cuda} * {b.d_cuda}) / ({b.cuda} * {b.cuda}))",
                     lambda env: (a.d_numpy(env) * b.numpy(env) - a.numpy(env) * b.d_numpy(env))
                     / np.square(b.numpy(env)))

    def _UnaryOp(self, n: ast.UnaryOp) -> _Node:
        a = self.build(n.operand)
        if isinstance(n.op, ast.Not):
            if a.type != "bool":
                raise self.fail("not takes a bool", TypeError)
            return _Node("bool", f"(!{a.cuda})", lambda env: np.logical_not(a.numpy(env)))
        if isinstance(n.op, (ast.USub, ast.UAdd)):
            if a.type == "bool":
                raise self.fail("a sign on a bool", TypeError)
            if isinstance(n.op, ast.UAdd):
                return a
            return _Node(a.type, f"(-{a.cuda})", lambda env: -a.numpy(env), f"(-{a.d_cuda})",
                         lambda env: -a.d_numpy(env))
        raise self.fail(f"the operator {type(n.op).__name__} is not part of the language")

    def _BoolOp(self, n: ast.BoolOp) -> _Node:
        parts = [self.build(v) for v in n.values]
        if any(p.type != "bool" for p in parts):
            raise self.fail("and / or take bools", TypeError)
        joiner, function = ("&&", np.logical_and) if isinstance(n.op, ast.And) else ("||", np.logical_or)

        def evaluate(env):
            result = parts[0].numpy(env)
            for p in parts[1:]:
                result = function(result, p.numpy(env))
            return result
        return _Node("bool", "(" + f" {joiner} ".join(p.cuda for p in parts) + ")", evaluate)

    def _Compare(self, n: ast.Compare) -> _Node:
        if len(n.ops) != 1:
            raise self.fail("a chained comparison (C reads a < b < c as (a < b) < c): write (a < b) and (b < c)")
        op = _COMPARE[type(n.ops[0])] if type(n.ops[0]) in _COMPARE else None
        if op is None:
            raise self.fail(f"the comparison {type(n.ops[0]).__name__} is not part of the language")
        a, b = self.build(n.left), self.build(n.comparators[0])
        if (a.type == "bool") != (b.type == "bool") or (a.type == "bool" and op not in ("==", "!=")):
            raise self.fail(f"{op} between {a.type} and {b.type}", TypeError)
        if "float" in (a.type, b.type):
            a, b = self.cast(a, "float"), self.cast(b, "float")
        function = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal,
                    "!=": np.not_equal}[op]
        return _Node("bool", f"({a.cuda} {op} {b.cuda})", lambda env: function(a.numpy(env), b.numpy(env)))

    def _Call(self, n: ast.Call) -> _Node:
        if not isinstance(n.func, ast.Name) or n.func.id not in FUNCTIONS:
            name = n.func.id if isinstance(n.func, ast.Name) else ast.unparse(n.func)
            raise self.fail(f"unknown function {name!r} (the functions are {', '.join(FUNCTIONS)})")
        name = n.func.id
        arity, result = FUNCTIONS[name]
        if n.keywords or len(n.args) != arity:
            raise self.fail(f"{name} takes {arity} positional argument{'s' if arity > 1 else ''}")
        args = [self.build(a) for a in n.args]
        if name == "where":
            return self._where(*args)
        if any(a.type == "bool" for a in args):
            raise self.fail(f"{name} of a bool", TypeError)
        if name == "int":
            (a,) = args
            return _Node("int", f"int({a.cuda})", lambda env: np.trunc(a.numpy(env)).astype(np.int64))
        if name == "float":
            return self.cast(args[0], "float")
        if result == "float":
            (a,) = (self.cast(x, "float") for x in args)
            return self._elementary(name, a)
        kind = "float" if "float" in (x.type for x in args) else "int"
        if kind == "float":
            args = [self.cast(x, "float") for x in args]
        if name == "abs":
            (a,) = args
            if kind == "int":
                return _Node("int", f"abs({a.cuda})", lambda env: np.abs(a.numpy(env)))
            return _Node("float", f"fabsf({a.cuda})", lambda env: np.abs(a.numpy(env)),
                         f"({a.cuda} < 0.f ? -{a.d_cuda} : {a.d_cuda})",
                         lambda env: np.where(a.numpy(env) < 0, -a.d_numpy(env), a.d_numpy(env)))
        a, b = args
        pick = np.minimum if name == "min" else np.maximum
        cuda = f"{_CUDA_FLOAT[name] if kind == 'float' else name}({a.cuda}, {b.cuda})"
        first = "<=" if name == "min" else ">="
        return _Node(kind, cuda, lambda env: pick(a.numpy(env), b.numpy(env)),
                     f"({a.cuda} {first} {b.cuda} ? {a.d_cuda} : {b.d_cuda})",
                     lambda env: np.where((a.numpy(env) <= b.numpy(env)) if name == "min"
                                          else (a.numpy(env) >= b.numpy(env)), a.d_numpy(env), b.d_numpy(env)))

    def _where(self, cond: _Node, a: _Node, b: _Node) -> _Node:
        if cond.type != "bool":
            raise self.fail("where's first argument is a bool", TypeError)
        if (a.type == "bool") != (b.type == "bool"):
            raise self.fail(f"where of {a.type} and {b.type}", TypeError)
        if "float" in (a.type, b.type):
            a, b = self.cast(a, "float"), self.cast(b, "float")
        return _Node(a.type, f"({cond.cuda} ? {a.cuda} : {b.cuda})",
                     lambda env: np.where(cond.numpy(env), a.numpy(env), b.numpy(env)),
                     f"({cond.cuda} ? {a.d_cuda} : {b.d_cuda})",
                     lambda env: np.where(cond.numpy(env), a.d_numpy(env), b.d_numpy(env)))

    @staticmethod
    def _elementary(name: str, a: _Node) -> _Node:
        """exp, log, tanh and sqrt of a float node, with their derivatives by the chain rule."""
        cuda = f"{_CUDA_FLOAT[name]}({a.cuda})"
        if name == "exp":
            return _Node("float", cuda, lambda env: np.exp(a.numpy(env)), f"({cuda} * {a.d_cuda})",
                         lambda env: np.exp(a.numpy(env)) * a.d_numpy(env))
        if name == "log":
            return _Node("float", cuda, lambda env: np.log(a.numpy(env)), f"({a.d_cuda} / {a.cuda})",
                         lambda env: a.d_numpy(env) / a.numpy(env))
        if name == "tanh":
            return _Node("float", cuda, lambda env: np.tanh(a.numpy(env)), f"((1.f - {cuda} * {cuda}) * {a.d_cuda})",
                         lambda env: (1 - np.tanh(a.numpy(env)) ** 2) * a.d_numpy(env))
        return _Node("float", cuda, lambda env: np.sqrt(a.numpy(env)), f"({a.d_cuda} / (2.f * {cuda}))",
                     lambda env: a.d_numpy(env) / (2 * np.sqrt(a.numpy(env))))
