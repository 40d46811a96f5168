"""The source of a Python function as an AST node, found from its code object: the file (or notebook
cell) it was defined in is parsed once, and the ``def`` or ``lambda`` that made the code object is
picked by name and first line (several lambdas on one line: by comparing their compiled code).

A function without source (typed at a bare REPL, made by ``exec`` of a string, a C callable)
raises ``MaskError`` saying so. Knows Python's ``ast`` and ``linecache``; nothing of masks.
"""
from __future__ import annotations

import ast
import linecache
import types
from typing import Union

from ..errors import MaskError

FunctionNode = Union[ast.FunctionDef, ast.Lambda]
_modules: dict = {}   # (filename, text length, text hash) -> parsed module
_nodes: dict = {}     # code object -> node (or the MaskError it raised)


def function_node(code: types.CodeType, what: str) -> FunctionNode:
    """The ``def`` or ``lambda`` node of ``code``; MaskError when there is no source for it."""
    found = _nodes.get(code)
    if found is None:
        try:
            found = _find(code, what)
        except MaskError as exc:
            found = exc
        _nodes[code] = found
    if isinstance(found, MaskError):
        raise found
    return found


def _module(filename: str, what: str) -> ast.Module:
    lines = linecache.getlines(filename)
    if not lines:
        raise MaskError(f"{what}: no source code is available for it (defined in {filename!r}: an interactive "
                        "prompt, exec() of a string, or a compiled module); define it in a file or a notebook cell")
    text = "".join(lines)
    key = (filename, len(text), hash(text))
    if key not in _modules:
        try:
            _modules[key] = ast.parse(text, filename)
        except SyntaxError as exc:
            raise MaskError(f"{what}: its source file {filename!r} does not parse ({exc})") from None
    return _modules[key]


def _find(code: types.CodeType, what: str) -> FunctionNode:
    tree = _module(code.co_filename, what)
    line = code.co_firstlineno
    candidates: list = []
    if code.co_name == "<lambda>":
        candidates = [n for n in ast.walk(tree) if isinstance(n, ast.Lambda) and n.lineno == line]
    else:
        candidates = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.name == code.co_name
                      and min([n.lineno] + [d.lineno for d in n.decorator_list]) == line]
    if len(candidates) > 1:
        candidates = [n for n in candidates if _same_code(n, code)]
    if not candidates:
        raise MaskError(f"{what}: its source was not found at {code.co_filename}:{line} (was the file edited since "
                        "it was imported?)")
    if len(candidates) > 1:
        raise MaskError(f"{what}: {len(candidates)} identical functions at {code.co_filename}:{line}; cannot tell "
                        "which one it is")
    node = candidates[0]
    if isinstance(node, ast.AsyncFunctionDef):
        raise MaskError(f"{what}: an async function is not a mask_mod")
    return node


def _same_code(node: FunctionNode, code: types.CodeType) -> bool:
    """Whether compiling ``node`` alone gives code like ``code`` (free names compile as globals and
    the bytecode differs with the context, so names, variables and constants are compared)."""
    try:
        wrapper = ast.Expression(node) if isinstance(node, ast.Lambda) else ast.Module([node], [])
        compiled = compile(ast.fix_missing_locations(wrapper), code.co_filename, "eval" if isinstance(node, ast.Lambda)
                           else "exec")
    except (SyntaxError, ValueError, TypeError):
        return False
    made = [c for c in compiled.co_consts if isinstance(c, types.CodeType)]
    return any(c.co_names == code.co_names and c.co_varnames == code.co_varnames
               and [k for k in c.co_consts if not isinstance(k, types.CodeType)]
               == [k for k in code.co_consts if not isinstance(k, types.CodeType)] for c in made)


__all__ = ["function_node", "FunctionNode"]
