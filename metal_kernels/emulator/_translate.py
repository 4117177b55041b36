"""Turn the Metal kernel text into C++ that compiles against metal_stdlib.hpp.

Rewrites are textual and keep the line count, so clang's line numbers (and the
lines in the checker's messages) are lines of the generated Metal text.
"""

from __future__ import annotations

import re

# a type name: `float`, `metal::atomic<uint>`, `vec<T, 4>`, `U::type`
_TYPE = r"(?:struct\s+)?[A-Za-z_][\w:]*(?:\s*<(?:[^<>;{}()]|<[^<>;{}()]*>)*>)?(?:::\w+)*"

_STD_ATTRS = ("maybe_unused", "likely", "unlikely", "fallthrough", "nodiscard", "noreturn", "clang::",
              "gnu::", "deprecated")

_ATTR_RE = re.compile(r"\[\[\s*([^\[\]]*?)\s*\]\]")
_HALF_LIT_RE = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")
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


def _keep_lines(repl: str, matched: str) -> str:
    return repl + "\n" * matched.count("\n")


def _strip_attr(m):
    body = m.group(1)
    if any(body.startswith(s) for s in _STD_ATTRS):
        return m.group(0)
    return ""


def translate(text: str) -> str:
    text = _ATTR_RE.sub(_strip_attr, text)
    text = _HALF_LIT_RE.sub(lambda m: f"((half)({m.group(1)}f))" if "." in m.group(1) or "e" in m.group(1).lower() else f"((half)({m.group(1)}))", text)

    counter = [0]

    def tg_array(m):
        counter[0] += 1
        t, name, dims = m.group(1), m.group(2), m.group(3)
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
        return _keep_lines(
            f'auto& {name} = *::mtl::tg_array<{t}, 1>({counter[0]}, "{name}").p;', m.group(0)
        )

    text = _TG_SCALAR_RE.sub(tg_scalar, text)

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
    text = _CAST_RE.sub(
        lambda m: "::mtl::scast<" if m.group(1) == "static_cast" else "::mtl::rcast<", text
    )
    return text


def launcher(func_name: str, targs: str, params) -> str:
    """C++ glue that calls the kernel for the current fiber's thread."""
    args = []
    k = 0
    for p in params:
        if p.kind == "ptr":
            args.append(f'::mtl::DevPtr<{p.type_str}>(({p.type_str}*)b[{k}], lo[{k}], hi[{k}], "{p.name}")')
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
