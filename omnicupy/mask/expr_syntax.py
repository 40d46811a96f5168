"""The allow-list grammar of user CUDA expressions (``cuda_mask``, ``cuda_score``, built-in masks'
``cuda_expr``), checked before anything is rendered.

An expression is pasted verbatim into a kernel's source, so it is read token by token the way the
C++ compiler would read it (maximal munch over every C++ punctuator, digraphs included) and every
token must be one an expression may contain:

- names: the index names ``b, h, q_idx, kv_idx`` (and ``score`` in score modifiers), the
  expression's own constants and lookup arrays, ``true``/``false``, the functions in ``FUNCTIONS``
  (each followed by its call's ``(``) and the casts ``(int)``, ``(float)``, ``(bool)``;
- decimal integer literals (optional ``u``) and decimal floating literals (optional ``f``);
- the operators ``+ - * / % ~ ! & | ^ << >> == != < > <= >= && || ? :`` (``*`` and ``&`` binary
  only), parentheses, and ``[ ]`` directly after a lookup array's name; commas only between a
  call's arguments.

Nothing else: no preprocessor (``#``, ``%:``), digraphs, trigraphs, braces, semicolons, comments,
string or character literals, backslashes, control characters (newlines, tabs), non-ASCII text,
assignments, ``++``/``--``, member access, ``::`` (except in ``omni::tanh_fast``) or keywords.
A refused expression raises ``ExpressionError`` naming the token.

Knows C++ lexing and what an expression may say; knows nothing of array contents, kernels or
rendering (mask/expressions.py builds on this).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

from ..errors import ExpressionError

#: Index names every expression sees, and the score a score modifier also sees.
INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")
SCORE_NAME = "score"
#: Math functions an expression may call (CUDA's device math, resolved by NVRTC without includes),
#: and the kernels' fast tanh (kernels/ptx.cuh; the elementwise kernels define it too).
FUNCTIONS = frozenset({
    "min", "max", "abs", "fabsf", "fminf", "fmaxf", "fmodf", "copysignf",
    "expf", "exp2f", "logf", "log2f", "log1pf", "powf", "sqrtf", "rsqrtf", "tanhf", "sinf", "cosf",
    "floorf", "ceilf", "roundf", "truncf",
    "omni::tanh_fast",
})
#: Types an expression may cast to, C style only: ``(int)x``, ``(float)x``, ``(bool)x``.
CAST_TYPES = frozenset({"int", "float", "bool"})
LITERAL_NAMES = frozenset({"true", "false"})

#: C++20 and CUDA keywords and alternative tokens: never usable as a name in an expression, nor as
#: the name of a constant or array (some would change what the kernel around it means).
CPP_KEYWORDS = frozenset("""
alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t char32_t class
compl concept const consteval constexpr constinit const_cast continue co_await co_return co_yield decltype
default delete do double dynamic_cast else enum explicit export extern false float for friend goto if inline
int long mutable namespace new noexcept not not_eq nullptr operator or or_eq private protected public register
reinterpret_cast requires return short signed sizeof static static_assert static_cast struct switch template
this thread_local throw true try typedef typeid typename union unsigned using virtual void volatile wchar_t
while xor xor_eq __global__ __device__ __host__ __shared__ __constant__ __restrict__ __forceinline__
__noinline__ __launch_bounds__ __grid_constant__ __managed__ __asm__ __volatile__ _Pragma
""".split())

# Every C++ punctuator (longest first, so that the regex munches as the compiler does), plus the
# comment openers, which the compiler would read as the start of a comment.
_PUNCTUATORS = sorted("""
%:%: <<= >>= ... ->* <=> <: :> <% %> %: ## :: .* -> += -= *= /= %= ^= &= |= == != <= >= && || << >> ++ --
// /* */ { } [ ] # ( ) ; : ? . ~ ! + - * / % ^ & | = < > ,
""".split(), key=len, reverse=True)
_ALLOWED_PUNCTUATORS = frozenset("( ) [ ] ? : ~ ! + - * / % ^ & | < > , == != <= >= && || << >>".split())
_WHY_NOT = {
    "#": "preprocessor", "##": "preprocessor", "%:": "the digraph of #", "%:%:": "the digraph of ##",
    "<%": "the digraph of {", "%>": "the digraph of }", "<:": "the digraph of [", ":>": "the digraph of ]",
    "{": "a brace", "}": "a brace", ";": "a statement separator", "//": "a comment", "/*": "a comment",
    "*/": "a comment", "=": "an assignment", "++": "an increment", "--": "a decrement", "::": "scope resolution",
    ".": "member access", "->": "member access", ".*": "member access", "->*": "member access",
    "...": "an ellipsis", "<=>": "a three-way comparison",
}

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*")
# A preprocessing number, as the compiler munches one (then checked against the forms we allow).
_PP_NUMBER = re.compile(r"\.?[0-9](?:[eEpP][+-]|[0-9A-Za-z_.]|')*")
_INT_LITERAL = re.compile(r"(0|[1-9][0-9]*)[uU]?\Z")
_FLOAT_LITERAL = re.compile(r"(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?[fF]?\Z|[0-9]+[eE][+-]?[0-9]+[fF]?\Z")
_PUNCT = re.compile("|".join(re.escape(p) for p in _PUNCTUATORS))
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Token:
    kind: str  # "name", "number" or "punct"
    text: str
    at: int    # character offset in the expression


@dataclass(frozen=True)
class Syntax:
    """What a checked expression uses: for each lookup array, how it is indexed (an index name when
    every subscript of that array is exactly that name, else None: a computed index)."""

    tokens: tuple
    array_index: tuple  # ((array name, (index name or None, ...)), ...)

    def index_names(self, array: str) -> tuple:
        return dict(self.array_index).get(array, ())


def _refuse(text: str, at: int, token: str, why: str) -> ExpressionError:
    return ExpressionError(f"CUDA expression {text!r}: {token!r} at offset {at} is not allowed ({why})")


def _describe_char(c: str) -> str:
    if c == "\n":
        return "a newline"
    if ord(c) < 32 or ord(c) == 127:
        return f"a control character (U+{ord(c):04X})"
    if ord(c) > 126:
        return f"a non-ASCII character (U+{ord(c):04X})"
    if c == "\\":
        return "a backslash"
    if c in "\"'":
        return "a string or character literal"
    return "not part of any allowed token"


def tokenize(text: str) -> list[Token]:
    """The tokens of ``text`` as the compiler would split them; refuses, in text order, characters no
    allowed token may hold, the trigraph prefix ``??`` and punctuators an expression may not use."""
    tokens: list[Token] = []
    at = 0
    while at < len(text):
        c = text[at]
        if c == " ":
            at += 1
            continue
        if not (32 < ord(c) < 127) or c in "\\\"'`$@":
            raise _refuse(text, at, c, _describe_char(c))
        if text.startswith("??", at):
            raise _refuse(text, at, "??", "a trigraph prefix")
        for kind, pattern in (("number", _PP_NUMBER), ("name", _NAME), ("punct", _PUNCT)):
            m = pattern.match(text, at)
            if m:
                if kind == "punct" and m.group() not in _ALLOWED_PUNCTUATORS:
                    raise _refuse(text, at, m.group(), _WHY_NOT.get(m.group(), "not an expression operator"))
                tokens.append(Token(kind, m.group(), at))
                at = m.end()
                break
        else:
            raise _refuse(text, at, c, _describe_char(c))
    return tokens


def _check_number(text: str, tok: Token) -> None:
    s = tok.text
    if _INT_LITERAL.match(s):
        if int(s.rstrip("uU")) > _INT64_MAX:
            raise _refuse(text, tok.at, s, "an integer literal beyond 64 bits")
        return
    if _FLOAT_LITERAL.match(s):
        value = float(s.rstrip("fF"))
        limit = _FLOAT32_MAX if s[-1] in "fF" else float("inf")
        if not math.isfinite(value) or abs(value) > limit:
            raise _refuse(text, tok.at, s, "a floating literal that overflows its type")
        return
    if len(s) > 1 and s[0] == "0" and s[1:].isdigit():
        raise _refuse(text, tok.at, s, "an octal literal; write decimal numbers")
    raise _refuse(text, tok.at, s, "only decimal integer and floating literals are allowed")


@dataclass
class _Group:
    """An open ``(`` or ``[`` and what it allows."""

    opener: str
    kind: str  # "call", "cast", "group" or "index"
    pending_questions: int = 0
    array: Optional[str] = None
    first: int = 0  # index of the first token inside


def check(text: str, *, constants: Iterable[str] = (), arrays: Iterable[str] = (), score: bool = True) -> Syntax:
    """Check ``text`` against the grammar above; return what it uses, or raise ExpressionError."""
    if not isinstance(text, str) or not text.strip():
        raise ExpressionError("a CUDA expression must be a non-empty string")
    constants, arrays = frozenset(constants), frozenset(arrays)
    names = set(INDEX_NAMES) | ({SCORE_NAME} if score else set())
    tokens = tokenize(text)
    if not tokens:
        raise ExpressionError("a CUDA expression must be a non-empty string")
    stack: list[_Group] = [_Group("", "top")]
    subscripts: dict[str, list] = {}
    prev: Optional[Token] = None
    prev_closed_cast = False  # the previous token is the ')' of a cast: what follows is an operand
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        operand_before = prev is not None and not prev_closed_cast and (
            prev.kind in ("name", "number") or prev.text in (")", "]"))
        closed_cast = False
        if tok.kind == "number":
            _check_number(text, tok)
        elif tok.kind == "name":
            t = tok.text
            if t in FUNCTIONS:
                if nxt is None or nxt.text != "(":
                    raise _refuse(text, tok.at, t, "a function must be called: name(...)")
            elif t in CAST_TYPES:
                if prev is None or prev.text != "(" or stack[-1].kind != "group" or nxt is None or nxt.text != ")":
                    raise _refuse(text, tok.at, t, "types appear only in the casts (int), (float), (bool)")
                stack[-1].kind = "cast"
            elif t in arrays:
                if nxt is None or nxt.text != "[":
                    raise _refuse(text, tok.at, t, f"the lookup array {t} is only read as {t}[index]")
            elif t in constants or t in names or t in LITERAL_NAMES:
                pass
            elif t == SCORE_NAME:
                raise _refuse(text, tok.at, t, "a mask expression has no score")
            else:
                why = "a C++ keyword" if t in CPP_KEYWORDS else "not a known name"
                allowed = (f"names: {', '.join(sorted(names))}, the expression's constants and arrays, true/false, "
                           f"functions {', '.join(sorted(FUNCTIONS))}, casts (int) (float) (bool)")
                raise _refuse(text, tok.at, t, f"{why}; {allowed}")
        else:
            t = tok.text
            if t in ("*", "&") and not operand_before:
                raise _refuse(text, tok.at, t, "unary * and & (pointers) are not allowed")
            if t == "(":
                kind = "call" if prev is not None and prev.text in FUNCTIONS else "group"
                stack.append(_Group("(", kind, first=i + 1))
            elif t == "[":
                if prev is None or prev.text not in arrays:
                    raise _refuse(text, tok.at, t, "[ ] only index a lookup array: name[index]")
                stack.append(_Group("[", "index", array=prev.text, first=i + 1))
            elif t in (")", "]"):
                group = stack[-1]
                if group.opener != {")": "(", "]": "["}[t]:
                    raise _refuse(text, tok.at, t, "unbalanced brackets")
                if group.pending_questions:
                    raise _refuse(text, tok.at, t, "a '?' without its ':'")
                if group.first == i:
                    raise _refuse(text, tok.at, t, "empty brackets")
                stack.pop()
                if group.kind == "index":
                    inner = tokens[group.first:i]
                    sub = inner[0].text if len(inner) == 1 and inner[0].text in INDEX_NAMES else None
                    subscripts.setdefault(group.array, []).append(sub)
                closed_cast = group.kind == "cast"
            elif t == ",":
                if stack[-1].kind != "call" or stack[-1].pending_questions:
                    raise _refuse(text, tok.at, t, "commas only separate a call's arguments")
            elif t == "?":
                stack[-1].pending_questions += 1
            elif t == ":":
                if not stack[-1].pending_questions:
                    raise _refuse(text, tok.at, t, "a ':' without its '?'")
                stack[-1].pending_questions -= 1
        prev, prev_closed_cast = tok, closed_cast
    if len(stack) > 1:
        raise ExpressionError(f"CUDA expression {text!r}: unbalanced brackets (an unclosed {stack[-1].opener!r})")
    if stack[0].pending_questions:
        raise ExpressionError(f"CUDA expression {text!r}: a '?' without its ':'")
    array_index = tuple(sorted((name, tuple(subs)) for name, subs in subscripts.items()))
    return Syntax(tuple(tokens), array_index)


__all__ = ["INDEX_NAMES", "SCORE_NAME", "FUNCTIONS", "CAST_TYPES", "CPP_KEYWORDS", "Token", "Syntax", "tokenize",
           "check"]
