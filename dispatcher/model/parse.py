"""Read a world (or an SGLang context) back from its one-line repr, without running anything.

A replay line pasted from a CI log is data: ``parse_world`` accepts only a call of ``World``
(optionally holding ``moe=MoeConfig(...)``) whose arguments are keyword literals, checked
by ``ast.literal_eval`` and by the dataclasses' own validation; ``parse_context`` the same
for ``SGLangContext(...)``. Anything else is a ``BadWorld`` naming what was wrong; nothing in
the text is ever evaluated as code.
"""
from __future__ import annotations

import ast
from typing import Dict

from .sglang_context import SGLangContext
from .world import MoeConfig, World

__all__ = ["BadWorld", "parse_world", "parse_context", "parse_sequence", "MAX_WORLD_TEXT"]

MAX_WORLD_TEXT = 20_000  # characters: a 64-rank world's repr is well under 1,000
MAX_INT = 10**12  # no count of a world comes near it
_CLASSES = {"World": World, "MoeConfig": MoeConfig, "SGLangContext": SGLangContext}


class BadWorld(ValueError):
    """The text is not a world this suite can build."""


def parse_world(text: str) -> World:
    """``World(ep_size=4, dp_size=2, group_tokens=(5, 2), max_num_tokens=8)`` -> World."""
    return _parse(text, "World")


def parse_context(text: str) -> SGLangContext:
    """``SGLangContext(forward_mode='replay', ...)`` -> SGLangContext."""
    return _parse(text, "SGLangContext")


def parse_sequence(text: str):
    """``(World(...), World(...))`` -> a tuple of worlds; ``((World(...), SGLangContext(...)),
    ...)`` -> a tuple of (world, context) steps: a sequence of steps on one workspace, as a
    failing sequence test prints it."""
    tree = _tree(text, "sequence of World")
    if not isinstance(tree, (ast.Tuple, ast.List)) or not tree.elts:
        raise BadWorld("a sequence is a tuple of World(...) (or of (World(...), "
                       "SGLangContext(...)) pairs), as a failing sequence test prints it")
    if all(isinstance(e, ast.Tuple) for e in tree.elts):
        if any(len(e.elts) != 2 for e in tree.elts):
            raise BadWorld("each step of an SGLang sequence is (World(...), SGLangContext(...))")
        steps = tuple((_build(e.elts[0], "World"), _build(e.elts[1], "SGLangContext"))
                      for e in tree.elts)
        _one_workspace([w for w, _ in steps])
        return steps
    worlds = tuple(_build(e, "World") for e in tree.elts)
    _one_workspace(worlds)
    return worlds


def _one_workspace(worlds) -> None:
    shape = {(w.ep_size, w.max_num_tokens, w.moe.hidden_size, w.moe.top_k, w.moe.num_experts)
             for w in worlds}
    if len(shape) > 1:
        raise BadWorld("the steps of a sequence run on one workspace: they share ep_size, "
                       "max_num_tokens and the MoE layer's hidden_size, top_k and num_experts")


def _parse(text: str, expected: str):
    return _build(_tree(text, expected), expected)


def _tree(text: str, expected: str) -> ast.AST:
    if len(text) > MAX_WORLD_TEXT:
        raise BadWorld(f"{expected} text is {len(text)} characters (at most {MAX_WORLD_TEXT})")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise BadWorld(f"not a {expected}(...) repr: {exc.msg} at column {exc.offset}") from None
    except ValueError as exc:  # e.g. an integer literal past Python's digit limit
        raise BadWorld(f"not a {expected}(...) repr: {exc}") from None
    return tree.body


def _ints(value):
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _ints(v)
    else:
        yield value


def _build(node: ast.AST, expected: str):
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == expected):
        raise BadWorld(f"expected {expected}(...), got {ast.unparse(node)[:80]!r}")
    if node.args:
        raise BadWorld(f"{expected}(...) takes keyword arguments only "
                       f"(as a failing test prints it)")
    kwargs: Dict[str, object] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise BadWorld(f"{expected}(...): ** arguments are not accepted")
        if kw.arg in kwargs:
            raise BadWorld(f"{expected}(...): {kw.arg}= is given twice")
        if expected == "World" and kw.arg == "moe":
            kwargs["moe"] = _build(kw.value, "MoeConfig")
            continue
        try:
            kwargs[kw.arg] = value = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise BadWorld(f"{expected}({kw.arg}=...): only literals are accepted, got "
                           f"{ast.unparse(kw.value)[:80]!r}") from None
        if any(type(n) is int and abs(n) > MAX_INT for n in _ints(value)):
            raise BadWorld(f"{expected}({kw.arg}=...): a count above {MAX_INT:,} is no world "
                           f"this suite can build")
    try:
        return _CLASSES[expected](**kwargs)
    except TypeError as exc:
        raise BadWorld(f"{expected}(...): {exc}") from None
    except ValueError as exc:  # the dataclass's own validation
        raise BadWorld(f"{expected}(...) is not valid: {exc}") from None
