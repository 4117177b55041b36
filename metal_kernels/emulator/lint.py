"""Reject C++ that clang accepts but the Metal compiler does not (what the check pass cannot see).

MSL 3.1 §1.4.4 (Restrictions) removes from C++ among others dynamic_cast, typeid, recursive calls,
new/delete, goto, register and thread_local storage, virtual functions, exceptions and the C++
standard library; §2.1 has no double; §4.2 requires program-scope variables to be in the constant
address space (static local variables likewise). Lambdas capturing by reference are refused too. The text is checked as
written (header and body, before MLX adds the signature); messages name the part and the line.
"""

from __future__ import annotations

import re
from pathlib import Path

from ._translate import blank, lexical_spans, matching_bracket

_RULES = [
    (re.compile(r"\bdouble\b"), "`double` is not supported by Metal (use float)"),
    (re.compile(r"\bstd\s*::"), "`std::` is not available in Metal (use metal:: functions)"),
    (re.compile(r"\b(throw|try|catch)\b"), "exceptions (`{0}`) are not supported by Metal"),
    (re.compile(r"\bnew\b(?=\s*[\w(:\[])"), "`new` (dynamic allocation) is not supported by Metal"),
    (re.compile(r"\bdelete\b(?=\s*[\w(\[])"), "`delete` is not supported by Metal"),
    (re.compile(r"\b(malloc|calloc|realloc|free)\s*\("), "`{0}` is not available in Metal"),
    (re.compile(r"\b(printf|fprintf|sprintf|puts)\s*\("), "`{0}` is not available in Metal"),
    (re.compile(r"\bgoto\b"), "`goto` is not supported by Metal"),
    (re.compile(r"\[\s*&|\[[^\[\]]*,\s*&\s*\w*\s*\]\s*\("),
     "lambdas capturing by reference (`[&`) are not supported in Metal kernels"),
    (re.compile(r"#\s*include\s*<(?!metal)([^>]*)>"), "#include <{0}> is not available in Metal"),
    (re.compile(r"\bvirtual\b"), "virtual functions are not supported by Metal"),
    (re.compile(r"\b(thread_local|register)\b"), "the `{0}` storage class is not supported by Metal"),
    (re.compile(r"\b(dynamic_cast|typeid)\b"), "`{0}` (run-time type information) is not supported by Metal"),
]
_HERE = Path(__file__).resolve().parent


def _library_names() -> frozenset:
    """Function names of the Metal standard library stand-in: a header function of one of these
    names that calls the name is taken to call the library's overload (as MLX's prelude does for
    64-bit shuffles), not itself."""
    math = (_HERE / "mtl_math.h").read_text()
    names = set(re.findall(r"^MTL_[FI]\d(?:_NOBF)?\((\w+)", math, re.M))
    names |= set(re.findall(r"\binline\s+[\w:<>]+\s+(\w+)\s*\(", math))
    sync = (_HERE / "mtl_sync.h").read_text()
    names |= set(re.findall(r"\b((?:simd|quad|atomic|simdgroup)_\w+)\s*\(", sync))
    return frozenset(names)


_LIBRARY = _library_names()
_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "catch", "decltype", "alignof",
             "static_assert", "defined", "operator"}


def _strip(text: str) -> str:
    """Blank out comments and the insides of string/char literals, keeping every position."""
    out, at = [], 0
    for kind, i, j in lexical_spans(text):
        piece = text[i:j]
        out.append(text[at:i])
        out.append(blank(piece) if kind == "comment" else piece[0] + blank(piece[1:-1]) + piece[-1:] * (j - i >= 2))
        at = j
    out.append(text[at:])
    return "".join(out)


def _no_preprocessor(text: str) -> str:
    lines, cont = [], False
    for line in text.split("\n"):
        directive = cont or line.lstrip().startswith("#")
        cont = directive and line.rstrip().endswith("\\")
        lines.append(" " * len(line) if directive else line)
    return "\n".join(lines)


def _matching(text: str, i: int) -> int:
    """Index of the bracket closing the one at ``i`` (``len(text)`` if none)."""
    k = matching_bracket(text, i)
    return len(text) if k < 0 else k


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _declarations(text: str, start: int = 0, end: int | None = None):
    """Top-level declarations of a header: ("function", name_pos, prefix, body_start, body_end) or
    ("statement", start, text) for what ends with `;`. Namespaces are walked into."""
    end = len(text) if end is None else end
    i, stmt = start, start
    while i < end:
        c = text[i]
        if c == ";":
            yield ("statement", stmt, text[stmt:i])
            stmt = i + 1
        elif c in "([":
            i = _matching(text, i)
        elif c == "{":
            prefix = text[stmt:i]
            close = _matching(text, i)
            if re.match(r"\s*(inline\s+)?namespace\b[^=]*$", prefix) or re.match(r'\s*extern\s+"', prefix):
                yield from _declarations(text, i + 1, close)
                stmt = close + 1
            elif prefix.rstrip().endswith("=") or re.search(r"\b(struct|class|union|enum)\b", prefix) and \
                    not re.search(r"\)\s*(const\s*)?(thread\s*)?$", prefix.rstrip()):
                pass  # an initializer or a type definition: the statement goes on to its `;`
            else:
                yield ("function", stmt, prefix, i, close)
                stmt = close + 1
            i = close
        i += 1


def _program_scope(clean: str):
    """Program-scope variables must be in the constant address space (MSL §4.2)."""
    problems = []
    for d in _declarations(clean):
        if d[0] != "statement":
            continue
        _, pos, body = d
        s = " ".join(body.split())
        if not s or re.match(r"(typedef|using|template|static_assert|friend|namespace|extern)\b", s):
            continue
        if re.match(r"(struct|class|union|enum)\b", s) and not re.search(r"\}\s*[A-Za-z_]", s):
            continue  # a type (forward) declaration or definition
        head = s.split("=", 1)[0]
        if "(" in head and "=" not in s or re.search(r"\w\s*\(", head):
            continue  # a function declaration
        if re.search(r"\bconstant\b", s) or re.search(r"\bconstexpr\b", s):
            continue
        name = re.findall(r"([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)*$", head.strip())
        what = f"`{name[0]}`" if name else "variable"
        pos += len(body) - len(body.lstrip())
        problems.append(f"line {_line(clean, pos)}: program scope variable {what} must reside in the constant "
                        "address space (declare it `constant`; Metal has no mutable global memory)")
    return problems


_STATIC_LOCAL = re.compile(r"(?:^|(?<=[;{}]))\s*static\b([^;{}]*);")


def _static_locals(clean: str, spans):
    problems = []
    for a, b in spans:
        for m in _STATIC_LOCAL.finditer(clean, a, b):
            decl = m.group(1)
            if re.search(r"\bconstant\b", decl) or re.search(r"\bconstexpr\b", decl):
                continue
            name = re.findall(r"([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)*(?:=|$)", decl.split("=", 1)[0] + "=")
            what = f"`{name[0]}`" if name else ""
            problems.append(f"line {_line(clean, m.start(1))}: static local variable {what} must reside in the "
                            "constant address space (Metal has no static thread or device storage)")
    return problems


def _arity(params: str):
    """(required, total) parameter counts of a parameter list."""
    params = params.strip()
    if not params or params == "void":
        return 0, 0
    parts, depth, cur = [], 0, ""
    for ch in params:
        depth += ch in "(<[{"
        depth -= ch in ")>]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return sum("=" not in p for p in parts), len(parts)


def _args(text: str, open_paren: int) -> int:
    inner = text[open_paren + 1:_matching(text, open_paren)]
    if not inner.strip():
        return 0
    depth, n = 0, 1
    for ch in inner:
        depth += ch in "([{"
        depth -= ch in ")]}"
        n += ch == "," and depth == 0
    return n


def _recursion(clean: str):
    """Functions of the header that call themselves, directly or through other header functions."""
    defs = {}  # name -> list of (required, total, body_start, body_end, pos)
    for d in _declarations(clean):
        if d[0] != "function":
            continue
        _, pos, prefix, b0, b1 = d
        m = re.search(r"(?<![\w:])([A-Za-z_]\w*)\s*(?:<[^;{}()]*>)?\s*\(", prefix)
        if not m or m.group(1) in _KEYWORDS or m.group(1) in _LIBRARY:
            continue
        p_open = prefix.index("(", m.end() - 1)
        req, tot = _arity(prefix[p_open + 1:_matching(prefix, p_open)])
        defs.setdefault(m.group(1), []).append((req, tot, b0, b1, pos + m.start(1)))
    calls = {}
    for name, versions in defs.items():
        if len(versions) != 1:
            continue  # overloads: which one a call means is not decidable here
        _, _, b0, b1, _ = versions[0]
        out = set()
        for callee, vs in defs.items():
            if len(vs) != 1:
                continue
            req, tot = vs[0][0], vs[0][1]
            for m in re.finditer(r"(?<![\w.>:])" + re.escape(callee) + r"\s*(?:<[^;{}()]*>)?\s*\(", clean[b0:b1]):
                n = _args(clean, b0 + m.end() - 1)
                if req <= n <= tot:
                    out.add(callee)
                    break
        calls[name] = out
    problems, reported = [], set()
    for start in calls:
        path, seen = [start], {start}

        def walk(fn):
            for nxt in sorted(calls.get(fn, ())):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    path.append(nxt)
                    found = walk(nxt)
                    if found:
                        return found
                    path.pop()
            return None

        cycle = walk(start)
        if cycle and frozenset(cycle) not in reported:
            reported.add(frozenset(cycle))
            via = "" if len(cycle) == 2 else " (through " + " -> ".join(cycle[1:-1]) + ")"
            problems.append(f"line {_line(clean, defs[start][0][4])}: function `{start}` calls itself{via}; "
                            "Metal does not support recursion")
    return problems


def lint(source: str, header: str = "") -> list[str]:
    """Return a list of problems (empty when the text looks Metal-clean).

    Checks the kernel body and the header (each as written, before MLX adds the
    signature). Messages name the part (`header`/`source`) and the line.
    """
    problems = []
    for part, text in (("header", header), ("source", source)):
        if not text:
            continue
        clean = _strip(text)
        for rx, msg in _RULES:
            for m in rx.finditer(clean):
                line = clean.count("\n", 0, m.start()) + 1
                arg = m.group(1) if m.groups() else m.group(0)
                problems.append(f"{part} line {line}: " + msg.format(arg))
        code = _no_preprocessor(clean)
        if part == "header":
            problems.extend(f"{part} " + p for p in _program_scope(code))
            bodies = [(d[3], d[4]) for d in _declarations(code) if d[0] == "function"]
            problems.extend(f"{part} " + p for p in _static_locals(code, bodies))
            problems.extend(f"{part} " + p for p in _recursion(code))
        else:
            problems.extend(f"{part} " + p for p in _static_locals(code, [(0, len(code))]))
    return problems
