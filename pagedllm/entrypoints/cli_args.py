"""Command-line flags generated from ``EngineArgs``: one flag per field, typed by the field's type
and described by its docstring, so a new engine option is one field in engine/arg_utils.py.

Booleans are ``--flag`` / ``--no-flag`` as in vLLM (``--flag false`` works too), numbers parse
as their type, sizes and names stay strings for the config's own validation.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import typing
from dataclasses import MISSING, Field, fields
from typing import Any, Protocol

from pagedllm.engine.arg_utils import EngineArgs

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SubParsers(Protocol):
    """What ``ArgumentParser.add_subparsers()`` returns, as a command's ``add_parser(sub)`` uses it
    (argparse names that class only privately)."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


def parse_bool(text: str) -> bool:
    """"true"/"false" (also 1/0, yes/no, on/off) -> bool; anything else is an argparse error."""
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass and of its dataclass bases (its text on one line)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's docstring wins over its base's
        if klass is object or "__dataclass_fields__" not in vars(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _flag_type(hint: Any) -> type:
    """The argparse type of a field: bool, int, float or str (a union with str stays str)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if str in args:
        return str
    assert len(args) == 1 and args[0] in (bool, int, float), f"no flag type for {hint}"
    return args[0]


def _default(f: Field) -> Any:
    return None if f.default is MISSING else f.default


def add_engine_args(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """One flag per EngineArgs field, with dashes (``--max-num-seqs``).

    Returns each field's visible flag by field name, for a command that words one differently
    (``actions["seed"].help = ...``).
    """
    hints, docs = typing.get_type_hints(EngineArgs), field_docs(EngineArgs)
    group = parser.add_argument_group("engine options (LLM(...) keyword arguments)")
    actions: dict[str, argparse.Action] = {}
    for f in fields(EngineArgs):
        flag, kind, default = "--" + f.name.replace("_", "-"), _flag_type(hints[f.name]), _default(f)
        doc = docs.get(f.name, "").replace("%", "%%")
        if kind is bool:
            actions[f.name] = group.add_argument(
                flag, dest=f.name, nargs="?", const=True, default=default, type=parse_bool, metavar="true|false",
                help=f"{doc} (default: {default}; --no-{flag[2:]} sets false)")
            group.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=argparse.SUPPRESS)
        else:
            actions[f.name] = group.add_argument(flag, dest=f.name, type=kind, default=default,
                                                 help=f"{doc} (default: {default})")
    group.add_argument("--dequantize", dest="quantization", action="store_const", const=None,
                       help="Every weight dequantized to --dtype: quantization=None (a GGUF file's quantized matrices "
                            "are otherwise kept in their formats)")
    return actions


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The EngineArgs a parsed command line holds (a positional model, where the command has one, wins)."""
    values = {f.name: getattr(ns, f.name) for f in fields(EngineArgs)}
    if getattr(ns, "model_tag", None):
        values["model"] = ns.model_tag
    return EngineArgs(**values)
