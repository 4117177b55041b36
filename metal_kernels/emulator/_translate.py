"""Turn the Metal kernel text into C++ that compiles against metal_stdlib.hpp.

Two translations of the same text:

* ``"check"``: for the check pass (``-fsyntax-only`` with ``MTL_CHECK``): pointers keep Metal's
  address spaces (clang address spaces), threadgroup variables of the kernel become `extern`
  declarations (nothing to construct), C-style pointer casts go through ``::mtl::ccast`` (which refuses to change
  the address space). Everything Metal rejects should fail here.
* ``"run"``: for the build that runs: ``device``/``constant`` pointers become ``mtl::DevPtr``
  (bounds-checked), ``threadgroup`` pointers ``mtl::TgPtr``, threadgroup arrays live in the
  runtime's 32 KiB arena.

Both: Metal attributes ``[[...]]`` are dropped, vector constructors (``float4(a, b)``) and
``static_cast`` between vectors convert element-wise, ``1.0h`` is a half and ``1.0bf`` a bfloat,
and an unsuffixed floating literal is a float (Metal has no double). Rewrites touch code only:
comments are blanked and string literals kept as they are. Line structure is kept, so clang's
line numbers (and the lines in the checker's messages) are lines of the generated Metal text.
"""

from __future__ import annotations

import re

# a type name: `float`, `metal::atomic<uint>`, `vec<T, 4>`, `U::type`
_TYPE = r"(?:struct\s+)?[A-Za-z_][\w:]*(?:\s*<(?:[^<>;{}()]|<[^<>;{}()]*>)*>)?(?:::\w+)*"

_STD_ATTRS = ("maybe_unused", "likely", "unlikely", "fallthrough", "nodiscard", "noreturn", "clang::",
              "gnu::", "deprecated")

_ATTR_RE = re.compile(r"\[\[\s*([^\[\]]*?)\s*\]\]")
_NUM = r"(?:\d+\.\d*|\.\d+|\d+(?=[eE]))(?:[eE][+-]?\d+)?"
_HALF_LIT_RE = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")
_BF_LIT_RE = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)bf\b")
_DOUBLE_LIT_RE = re.compile(r"(?<![\w.])(" + _NUM + r")(?![\w.])")
_TG_ARRAY_RE = re.compile(
    r"\bthreadgroup\s+((?:const\s+)?" + _TYPE + r")\s+([A-Za-z_]\w*)\s*((?:\[[^\[\]]+\]\s*)+);"
)
_TG_SCALAR_RE = re.compile(r"\bthreadgroup\s+(" + _TYPE + r")\s+([A-Za-z_]\w*)\s*;")
_PTR_RE = re.compile(
    r"(?:\b(?:const|volatile)\s+)*\b(device|constant|threadgroup)\s+(?:(?:const|volatile)\s+)*("
    + _TYPE
    + r")\s*(?:(?:const|volatile)\s*)*\*"
)
_VEC_CTOR_RE = re.compile(
    r"(?<![\w.])(?:metal::)?(float|half|bfloat|int|uint|short|ushort|char|uchar|long|ulong|bool)"
    r"([234])\s*\("
)
_VEC_TMPL_CTOR_RE = re.compile(r"(?<![\w.])(?:metal::)?vec\s*<\s*([^<>,]+?)\s*,\s*([^<>]+?)\s*>\s*\(")
_CAST_RE = re.compile(r"(?<![\w:])(static_cast|reinterpret_cast)\s*<")
# `(const device float4*)`: a C-style cast to a pointer type
_CCAST_RE = re.compile(
    r"\(\s*((?:(?:const|volatile)\s+)*(?:(?:device|constant|threadgroup|thread)\s+)?(?:(?:const|volatile)\s+)*"
    + _TYPE
    + r"\s*(?:\*\s*(?:const\s*)?)+)\)(?=\s*[\w(&*])"
)
_KEYWORDS_NOT_TYPES = {"return", "sizeof", "case", "else", "do", "goto", "throw", "new", "delete"}


def _keep_lines(repl: str, matched: str) -> str:
    return repl + "\n" * matched.count("\n")


def _strip_attr(m):
    body = m.group(1)
    if any(body.startswith(s) for s in _STD_ATTRS):
        return m.group(0)
    return ""


def lexical_spans(text: str):
    """Comments and string/char literals of C++ text, in order: ``(kind, start, end)`` with kind
    ``"comment"`` (``//`` to the end of the line, or ``/* ... */``) or ``"literal"`` (quotes
    included; an unterminated one ends at the end of its line). Everything between spans is code."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            yield "comment", i, j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            yield "comment", i, j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            yield "literal", i, j
        else:
            i += 1
            continue
        i = j


def blank(piece: str) -> str:
    """``piece`` with every character but newlines turned into a space."""
    return "".join(ch if ch == "\n" else " " for ch in piece)


def mask_comments_and_strings(text: str):
    """Blank comments (keeping newlines) and replace string/char literals by placeholders.

    Returns ``(masked_text, literals)``; `unmask` puts the literals back.
    """
    out, literals, at = [], [], 0
    for kind, i, j in lexical_spans(text):
        out.append(text[at:i])
        if kind == "comment":
            out.append(blank(text[i:j]))
        else:
            out.append(f"\x00{len(literals)}\x00")
            literals.append(text[i:j])
        at = j
    out.append(text[at:])
    return "".join(out), literals


def unmask(text: str, literals) -> str:
    return re.sub(r"\x00(\d+)\x00", lambda m: literals[int(m.group(1))], text)


def _operand_end(text: str, i: int) -> int:
    """End of the unary-expression operand starting at ``i`` (after a C-style cast), or -1."""
    n = len(text)
    while i < n and text[i] in " \t\n":
        i += 1
    if i >= n:
        return -1
    if text[i] in "&*":
        return _operand_end(text, i + 1)
    if text[i] == "(":
        j = _balanced(text, i)
    else:
        m = re.compile(r"(?:::)?[A-Za-z_0-9][\w]*(?:::[A-Za-z_]\w*)*").match(text, i)
        if not m:
            return -1
        j = m.end()
    while j >= 0 and j < n:  # postfix: [..] (..) .member ->member
        k = j
        while k < n and text[k] in " \t":
            k += 1
        if k < n and text[k] in "[(":
            j = _balanced(text, k)
        elif text.startswith("->", k) or (k < n and text[k] == "." and not text[k + 1 : k + 2].isdigit()):
            m = re.compile(r"(?:->|\.)\s*[A-Za-z_]\w*").match(text, k)
            if not m:
                break
            j = m.end()
        else:
            break
    return j


def matching_bracket(text: str, i: int) -> int:
    """Index of the bracket closing the ``(``, ``[`` or ``{`` at ``i``, or -1 when it is never closed."""
    pairs = {"{": "}", "(": ")", "[": "]"}
    stack = []
    for k in range(i, len(text)):
        ch = text[k]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return k
    return -1


def _balanced(text: str, i: int) -> int:
    """End (one past the closing bracket) of the bracketed group at ``i``, or -1."""
    k = matching_bracket(text, i)
    return -1 if k < 0 else k + 1


def _c_style_casts(text: str) -> str:
    """``(T*)x`` -> ``::mtl::ccast<T*>(x)`` (check pass)."""
    out, pos = [], 0
    for m in _CCAST_RE.finditer(text):
        if m.start() < pos:
            continue
        first = re.match(r"[A-Za-z_]\w*", m.group(1).strip())
        if first and first.group(0) in _KEYWORDS_NOT_TYPES:
            continue
        if re.search(r"\b(sizeof|alignof|decltype|alignas)\s*$", text[:m.start()]):
            continue
        end = _operand_end(text, m.end())
        if end < 0:
            continue
        operand = text[m.end():end]
        if re.match(r"\s*(const|volatile|noexcept|override|final|thread|device|constant|threadgroup)\b", operand):
            continue
        out.append(text[pos:m.start()])
        out.append(f"::mtl::ccast<{m.group(1)}>({operand})")
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _literals(text: str) -> str:
    def half(m):
        v = m.group(1)
        return f"((half)({v}f))" if ("." in v or "e" in v.lower()) else f"((half)({v}))"

    text = _HALF_LIT_RE.sub(half, text)
    text = _BF_LIT_RE.sub(lambda m: f"((bfloat)({m.group(1)}f))" if ("." in m.group(1) or "e" in m.group(1).lower())
                          else f"((bfloat)({m.group(1)}))", text)
    # Metal has no double: an unsuffixed floating literal is a float
    return _DOUBLE_LIT_RE.sub(lambda m: m.group(1) + "f", text)


def _translate_part(text: str, mode: str, in_kernel: bool, counter: list) -> str:
    text = _ATTR_RE.sub(_strip_attr, text)
    text = _literals(text)

    def tg_array(m):
        counter[0] += 1
        t, name, dims = m.group(1), m.group(2), m.group(3)
        if mode == "check":
            if not in_kernel:
                return m.group(0)  # clang refuses it: "automatic variable qualified with an address space"
            return "extern " + m.group(0)
        ds = ", ".join(f"({d.strip()})" for d in re.findall(r"\[([^\[\]]+)\]", dims))
        t = re.sub(r"^const\s+", "", t)
        return _keep_lines(
            f'auto {name} = ::mtl::tg_array<{t}, {ds}>({counter[0]}, "{name}");', m.group(0)
        )

    text = _TG_ARRAY_RE.sub(tg_array, text)

    def tg_scalar(m):
        counter[0] += 1
        t, name = m.group(1), m.group(2)
        if t in ("return",):
            return m.group(0)
        if mode == "check":
            return "extern " + m.group(0) if in_kernel else m.group(0)
        return _keep_lines(
            f'auto& {name} = *::mtl::tg_array<{t}, 1>({counter[0]}, "{name}").p;', m.group(0)
        )

    text = _TG_SCALAR_RE.sub(tg_scalar, text)

    if mode == "check":
        text = _c_style_casts(text)
    else:
        def ptr(m):
            space, t = m.group(1), m.group(2).strip()
            if t == "auto":
                return _keep_lines("auto", m.group(0))
            cls = "TgPtr" if space == "threadgroup" else "DevPtr"
            return _keep_lines(f"::mtl::{cls}<{t}>", m.group(0))

        text = _PTR_RE.sub(ptr, text)
    text = _VEC_CTOR_RE.sub(lambda m: _keep_lines(f"::mtl::mk<{m.group(1)}, {m.group(2)}>(", m.group(0)), text)
    text = _VEC_TMPL_CTOR_RE.sub(
        lambda m: _keep_lines(f"::mtl::mk<{m.group(1)}, {m.group(2)}>(", m.group(0)), text
    )

    def cast(m):
        if m.group(1) == "static_cast":
            if mode == "check" and _cast_target_is_pointer(text, m.end()):
                return m.group(0)
            return "::mtl::scast<"
        return m.group(0) if mode == "check" else "::mtl::rcast<"

    return _CAST_RE.sub(cast, text)


def _cast_target_is_pointer(text: str, i: int) -> bool:
    depth, k = 1, i
    while k < len(text) and depth:
        depth += {"<": 1, ">": -1}.get(text[k], 0)
        k += 1
    target = text[i:k - 1]
    return "*" in target or "&" in target


def _mark_stores(text: str, names) -> str:
    """``out[i] = v`` -> ``out.store_at(i) = v`` for the given output names (run build): the race
    checker then knows a store even when it writes the value already there."""
    edits = []
    for name in names:
        for m in re.finditer(r"(?<![\w.>:])" + re.escape(name) + r"\s*\[", text):
            close = _balanced(text, m.end() - 1)
            if close < 0:
                continue
            after = re.match(r"\s*=(?!=)", text[close:])
            if after:
                edits.append((m.start(), m.end(), close - 1, name))
    for start, open_end, close_pos, name in sorted(edits, reverse=True):
        text = text[:start] + f"{name}.store_at(" + text[open_end:close_pos] + ")" + text[close_pos + 1:]
    return text


def translate(text: str, mode: str = "run", kernel_start: int = 0, stores=()) -> str:
    """Translate generated kernel text; ``text[kernel_start:]`` is the kernel function (after the
    header), where threadgroup variables may be declared. ``stores``: the (non-atomic) output
    names whose subscript assignments are marked as stores in the run build."""
    if mode not in ("run", "check"):
        raise ValueError(f"mode must be 'run' or 'check', got {mode!r}")
    masked, literals = mask_comments_and_strings(text)
    counter = [0]
    head = _translate_part(masked[:kernel_start], mode, False, counter)
    body = masked[kernel_start:]
    if mode == "run" and stores:
        body = _mark_stores(body, stores)
    body = _translate_part(body, mode, True, counter)
    return unmask(head + body, literals)


def launcher(func_name: str, targs: str, params) -> str:
    """C++ glue that calls the kernel for the current fiber's thread."""
    args = []
    k = 0
    for p in params:
        if p.kind == "ptr":
            out = k if p.source and p.source[0] == "output" else -1
            args.append(f'::mtl::DevPtr<{p.type_str}>(({p.type_str}*)b[{k}], lo[{k}], hi[{k}], "{p.name}", {out})')
            k += 1
        elif p.kind == "ref":
            args.append(f"*(const {p.type_str}*)b[{k}]")
            k += 1
        elif p.type_str == "uint3":
            args.append(f"::mtl::u3(ti->{p.name})")
        else:
            args.append(f"(uint)ti->{p.name}")
    joined = ",\n      ".join(args)
    return (
        '\n#line 1 "emulator-launcher"\n'
        'extern "C" void mtl_kernel_entry(void* const* b, void* const* lo, void* const* hi) {\n'
        "  const mtl_thread_info* ti = mtl_rt_thread();\n"
        "  (void)ti; (void)lo; (void)hi;\n"
        f"  {func_name}{targs}(\n      {joined});\n"
        "}\n"
    )
