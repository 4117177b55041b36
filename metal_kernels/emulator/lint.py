"""Reject C++ that clang accepts but the Metal compiler does not."""

from __future__ import annotations

import re

_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "catch", "decltype", "alignof",
             "static_assert", "defined"}

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
]


def _strip(text: str) -> str:
    """Blank out comments and string/char literals, keeping line structure."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * (j - i - 2) + (c if j - i >= 2 else ""))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _matching_brace(text, open_idx):
    depth = 0
    for k in range(open_idx, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(text)


_FUNC_DEF = re.compile(r"\b([A-Za-z_]\w*)\s*(?:<[^;{}()]*>)?\s*\(([^;{}]*)\)\s*(?:const\s*)?(?:->[^;{}]*)?\{")


def _recursion(text):
    problems = []
    for m in _FUNC_DEF.finditer(text):
        name = m.group(1)
        if name in _KEYWORDS:
            continue
        # skip control statements like `} else if (...) {` whose keyword is the name
        start = m.end() - 1
        end = _matching_brace(text, start)
        body = text[start + 1 : end]
        if re.search(r"(?<![\w.>:])" + re.escape(name) + r"\s*(?:<[^;{}()]*>)?\s*\(", body):
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"line {line}: function `{name}` calls itself; Metal does not support recursion")
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
        problems.extend(f"{part} " + p for p in _recursion(clean))
    return problems
