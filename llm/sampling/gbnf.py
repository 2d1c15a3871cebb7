"""llama.cpp's GBNF grammar dialect: a parser, checks, and the translation to llguidance's Lark.

GBNF (grammars/README.md in llama.cpp): rules `name ::= alternatives`, names of letters,
digits, `-` and `_`; literals "..." and character classes [...] / [^...] with the escapes
\\xHH, \\uHHHH, \\UHHHHHHHH, \\t \\n \\r \\\\ \\" \\[ \\] \\- ; `.` for any character; groups
( ); repetition * + ? {m} {m,} {m,n} {,n}; `#` comments; newlines end a rule except inside
groups. A GBNF grammar is a context-free grammar over characters, so each rule becomes a
Lark parser rule (never a lexer terminal: greedy lexing would reject `word word` on "ab")
and each character of a literal or class one lexeme; llguidance's Earley parser then
accepts exactly the strings llama.cpp's grammar engine accepts.

Checked before any decoding: syntax, undefined rules, a missing root, repetition bounds, and
rules that can never finish (`a ::= a "x"` alone: recursion without progress).
"""
from __future__ import annotations

from dataclasses import dataclass

from llm.errors import GrammarError

MAX_REPEAT = 4096          # the largest {m,n} bound: llguidance expands bounded repetitions
MAX_DEPTH = 256            # nesting of groups


@dataclass
class Lit:
    text: str


@dataclass
class CharClass:
    ranges: list[tuple[int, int]]
    negated: bool


@dataclass
class AnyChar:
    pass


@dataclass
class Ref:
    name: str
    line: int


@dataclass
class Seq:
    items: list


@dataclass
class Alt:
    options: list[Seq]


@dataclass
class Rep:
    item: object
    lo: int
    hi: int | None


_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "/": "/",
            "'": "'", "0": "\0"}
_HEX_LEN = {"x": 2, "u": 4, "U": 8}


def _is_name_char(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c in "-_")


class _Parser:
    def __init__(self, text: str):
        self.s = text
        self.i = 0
        self.depth = 0

    def error(self, msg: str) -> GrammarError:
        line = self.s.count("\n", 0, self.i) + 1
        col = self.i - (self.s.rfind("\n", 0, self.i) + 1) + 1
        near = self.s[self.i:self.i + 20]
        return GrammarError(f"grammar: line {line}, column {col}: {msg} (at {near!r})")

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def skip(self, newlines: bool) -> None:
        while self.i < len(self.s):
            c = self.s[self.i]
            if c in " \t" or (newlines and c in "\r\n"):
                self.i += 1
            elif c == "#":
                while self.i < len(self.s) and self.s[self.i] not in "\r\n":
                    self.i += 1
            else:
                break

    def name(self) -> str:
        start = self.i
        while self.i < len(self.s) and _is_name_char(self.s[self.i]):
            self.i += 1
        if self.i == start:
            raise self.error("expected a rule name")
        return self.s[start:self.i]

    def integer(self) -> int:
        start = self.i
        while self.i < len(self.s) and self.s[self.i].isascii() and self.s[self.i].isdigit():
            self.i += 1
        if self.i == start:
            raise self.error("expected a number")
        if self.i - start > 9:
            raise self.error("repetition count too large")
        return int(self.s[start:self.i])

    def char(self, end: str) -> int:
        """One possibly escaped character of a literal or class, as a code point."""
        if self.i >= len(self.s):
            raise self.error("unterminated " + ("literal" if end == '"' else "character class"))
        c = self.s[self.i]
        if c != "\\":
            if c in "\r\n" and end == '"':
                raise self.error("unterminated literal (newline inside)")
            self.i += 1
            return ord(c)
        e = self.s[self.i + 1:self.i + 2]
        if e in _HEX_LEN:
            n = _HEX_LEN[e]
            digits = self.s[self.i + 2:self.i + 2 + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{e} needs {n} hex digits")
            cp = int(digits, 16)
            if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
                raise self.error(f"\\{e}{digits} is not a Unicode scalar value")
            self.i += 2 + n
            return cp
        if e in _ESCAPES:
            self.i += 2
            return ord(_ESCAPES[e])
        raise self.error(f"unknown escape \\{e}")

    def literal(self) -> Lit:
        self.i += 1
        out = []
        while self.peek() != '"':
            out.append(chr(self.char('"')))
        self.i += 1
        return Lit("".join(out))

    def char_class(self) -> CharClass:
        self.i += 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges = []
        while self.peek() != "]":
            lo = self.char("]")
            hi = lo
            if self.peek() == "-" and self.s[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.char("]")
                if hi < lo:
                    raise self.error(f"character range {chr(lo)!r}-{chr(hi)!r} is reversed")
            ranges.append((lo, hi))
        self.i += 1
        if not ranges and not negated:
            raise self.error("empty character class")
        return CharClass(ranges, negated)

    def repetition(self, item):
        c = self.peek()
        if c == "*":
            self.i += 1
            return Rep(item, 0, None)
        if c == "+":
            self.i += 1
            return Rep(item, 1, None)
        if c == "?":
            self.i += 1
            return Rep(item, 0, 1)
        if c != "{":
            return item
        self.i += 1
        self.skip(True)
        lo = 0 if self.peek() == "," else self.integer()
        self.skip(True)
        hi: int | None = lo
        if self.peek() == ",":
            self.i += 1
            self.skip(True)
            hi = self.integer() if self.peek().isdigit() else None
            self.skip(True)
        if self.peek() != "}":
            raise self.error("expected '}' to close a repetition")
        self.i += 1
        if hi is not None and hi < lo:
            raise self.error(f"repetition {{{lo},{hi}}}: the maximum is below the minimum")
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.error(f"repetition bound above {MAX_REPEAT}")
        return Rep(item, lo, hi)

    def sequence(self, nested: bool) -> Seq:
        items = []
        while True:
            self.skip(nested)
            c = self.peek()
            item: Lit | CharClass | AnyChar | Alt | Ref
            if c == '"':
                item = self.literal()
            elif c == "[":
                item = self.char_class()
            elif c == ".":
                self.i += 1
                item = AnyChar()
            elif c == "(":
                self.i += 1
                self.depth += 1
                if self.depth > MAX_DEPTH:
                    raise self.error(f"groups nested deeper than {MAX_DEPTH}")
                item = self.alternatives(nested=True)
                self.skip(True)
                if self.peek() != ")":
                    raise self.error("expected ')'")
                self.i += 1
                self.depth -= 1
            elif c and _is_name_char(c):
                line = self.s.count("\n", 0, self.i) + 1
                start = self.i
                item = Ref(self.name(), line)
                self.skip(nested)
                if self.s.startswith("::=", self.i):
                    self.i = start          # the next rule starts here: this sequence ended
                    break
            else:
                break
            self.skip(nested)
            items.append(self.repetition(item))
        return Seq(items)

    def alternatives(self, nested: bool) -> Alt:
        options = [self.sequence(nested)]
        while True:
            self.skip(nested)
            if self.peek() != "|":
                return Alt(options)
            self.i += 1
            self.skip(True)
            options.append(self.sequence(nested))

    def grammar(self) -> dict[str, Alt]:
        rules: dict[str, Alt] = {}
        self.skip(True)
        while self.i < len(self.s):
            name = self.name()
            self.skip(False)
            if not self.s.startswith("::=", self.i):
                raise self.error(f"expected '::=' after rule name {name!r}")
            self.i += 3
            self.skip(True)
            alt = self.alternatives(nested=False)
            if name in rules:
                raise self.error(f"rule {name!r} is defined twice")
            rules[name] = alt
            self.skip(True)
            if self.i < len(self.s) and not _is_name_char(self.peek()):
                raise self.error("unexpected character")
        return rules


def parse(text: str) -> dict[str, Alt]:
    """Rules of a GBNF grammar, in order; GrammarError names the line and column at fault."""
    return _Parser(text).grammar()


def _walk(node):
    yield node
    if isinstance(node, Alt):
        for s in node.options:
            yield from _walk(s)
    elif isinstance(node, Seq):
        for s in node.items:
            yield from _walk(s)
    elif isinstance(node, Rep):
        yield from _walk(node.item)


def check(rules: dict[str, Alt], root: str) -> None:
    """Undefined rules, a missing root, and rules that can never finish."""
    if not rules:
        raise GrammarError("grammar: no rules")
    if root not in rules:
        raise GrammarError(f"grammar: no rule named {root!r} (the root)")
    for name, alt in rules.items():
        for node in _walk(alt):
            if isinstance(node, Ref) and node.name not in rules:
                raise GrammarError(f"grammar: rule {name!r} uses undefined rule {node.name!r} (line {node.line})")
    # productive rules: those that derive some finite string (a fixed point)
    done: set[str] = set()

    def finishes(node) -> bool:
        if isinstance(node, Ref):
            return node.name in done
        if isinstance(node, Alt):
            return any(finishes(s) for s in node.options)
        if isinstance(node, Seq):
            return all(finishes(s) for s in node.items)
        if isinstance(node, Rep):
            return node.lo == 0 or finishes(node.item)
        return True

    changed = True
    while changed:
        changed = False
        for name, alt in rules.items():
            if name not in done and finishes(alt):
                done.add(name)
                changed = True
    reachable = {root}
    stack = [root]
    while stack:
        for node in _walk(rules[stack.pop()]):
            if isinstance(node, Ref) and node.name not in reachable:
                reachable.add(node.name)
                stack.append(node.name)
    stuck = sorted(reachable - done)
    if stuck:
        raise GrammarError(f"grammar: rule {stuck[0]!r} can never finish (recursion without progress)")


# --- Lark output ------------------------------------------------------------------------------


def _cp(c: int) -> str:
    return f"\\x{{{c:x}}}"


def _lark(node, names: dict[str, str]) -> str:
    if isinstance(node, Lit):
        if not node.text:
            return '""'
        chars = [f"/{_cp(ord(c))}/" for c in node.text]
        return chars[0] if len(chars) == 1 else "(" + " ".join(chars) + ")"
    if isinstance(node, CharClass):
        body = "".join(_cp(lo) if lo == hi else f"{_cp(lo)}-{_cp(hi)}" for lo, hi in node.ranges)
        if node.negated:
            return f"/[^{body}]/" if body else "/(?s:.)/"
        return f"/[{body}]/"
    if isinstance(node, AnyChar):
        return "/(?s:.)/"
    if isinstance(node, Ref):
        return names[node.name]
    if isinstance(node, Seq):
        if not node.items:
            return '""'
        return "(" + " ".join(_lark(i, names) for i in node.items) + ")"
    if isinstance(node, Alt):
        return "(" + " | ".join(_lark(s, names) for s in node.options) + ")"
    if isinstance(node, Rep):
        if node.hi == 0:
            return '""'
        inner = _lark(node.item, names)
        if (node.lo, node.hi) == (0, None):
            return inner + "*"
        if (node.lo, node.hi) == (1, None):
            return inner + "+"
        if (node.lo, node.hi) == (0, 1):
            return inner + "?"
        return inner + "{" + str(node.lo) + "," + ("" if node.hi is None else str(node.hi)) + "}"
    raise TypeError(node)


def to_lark(text: str, root: str = "root") -> str:
    """A GBNF grammar as llguidance Lark (every rule a parser rule, every character a lexeme)."""
    rules = parse(text)
    check(rules, root)
    names = {name: f"r{i}_" + "".join(c if c.isalnum() else "_" for c in name.lower())
             for i, name in enumerate(rules)}
    lines = ["%llguidance {}", "", f"start: {names[root]}"]
    lines += [f"{names[name]}: {_lark(alt, names)}" for name, alt in rules.items()]
    return "\n".join(lines) + "\n"
