"""Turn the check pass's clang diagnostics into the Metal compiler's wording.

The check pass compiles the kernel with Metal's address spaces as clang address spaces, so clang's
messages are the Metal compiler's (Metal's compiler is clang) once the address spaces carry their
Metal names. Errors located in the emulator's prelude are reported at the kernel line that led to
them (the first "in instantiation of ... requested here" note in the kernel's text).
"""

from __future__ import annotations

import re

_DIAG = re.compile(r"^(?P<file>.*?):(?P<line>\d+):(?P<col>\d+): (?P<kind>fatal error|error|warning|note): (?P<msg>.*)$")
_SPACES = {"1": "device", "2": "constant", "3": "threadgroup"}
_ATOMIC_HINT = ("Metal's atomic types are atomic_int, atomic_uint, atomic_bool, atomic_float and atomic<ulong> "
                "(MSL §6.15); atomic_outputs=True needs an int32, uint32 or float32 output")


def _metal_words(msg: str) -> str:
    msg = re.sub(r"__attribute__\(\(address_space\((\d)\)\)\)", lambda m: _SPACES.get(m.group(1), m.group(0)), msg)
    msg = re.sub(r"address space '(\d)'", lambda m: f"address space '{_SPACES.get(m.group(1), m.group(1))}'", msg)
    # clang prints `device float const *`; Metal's compiler prints `const device float *`
    msg = re.sub(r"'(device|constant|threadgroup) ([^'*&]+?) const ([*&])", r"'const \1 \2 \3", msg)
    msg = re.sub(r" \(aka '[^']*'\)", "", msg)
    msg = re.sub(r"\b_Float16\b", "half", msg)
    msg = re.sub(r"__bf16\b", "bfloat", msg).replace("metal::", "")
    return re.sub(r"\s+", " ", msg).strip()


class _Group:
    def __init__(self, d):
        self.d = d
        self.notes = []


def _parse(stderr: str):
    groups = []
    for raw in stderr.splitlines():
        m = _DIAG.match(raw.strip())
        if not m:
            continue
        d = m.groupdict()
        if d["kind"] == "note":
            if groups:
                groups[-1].notes.append(d)
        else:
            groups.append(_Group(d))
    return groups


def _reword(msg: str, source_line: str, notes) -> str:
    if "automatic variable qualified with an address space" in msg:
        if re.search(r"\bthreadgroup\b", source_line):
            return ("threadgroup variables can only be declared in the body of a kernel function, not in "
                    "a helper function (pass a threadgroup pointer to the helper instead)")
        if re.search(r"\bconstant\b", source_line):
            return "variables in the constant address space must be declared at program scope"
        return "a local variable cannot be declared in the device address space"
    m = re.match(r"reinterpret_cast from ('[^']*') to ('[^']*') is not allowed", msg)
    if m and any("ccast" in n["msg"] for n in notes):
        source, target = m.group(1), m.group(2)
        for n in notes:  # `ccast<To, From>` names the source's pointee as the kernel wrote it
            c = re.search(r"ccast<(.+), (.+?)>' requested", _metal_words(n["msg"]))
            if c:
                source = f"'{c.group(2)} *'"
        return f"C-style cast from {source} to {target} converts between mismatching address spaces"
    m = re.match(r"implicit conversion (?:loses floating-point precision|turns floating-point number into "
                 r"integer)?:? ?('[^']*') to ('bfloat[^']*')", msg)
    if m:
        return (f"implicit conversion from {m.group(1)} to 'bfloat' is not allowed (MSL §2.1: neither float "
                "nor half converts implicitly to bfloat; use static_cast<bfloat>)")
    if ("incomplete type" in msg or "undefined template" in msg) and "atomic<" in msg:
        return f"{msg} ({_ATOMIC_HINT})"
    return msg


# Copying a struct out of (into) device, constant or threadgroup memory: clang's implicit copy/move
# constructors and assignments take generic-address-space references, Metal's accept every address
# space. Such errors are not the kernel's.
_IMPLICIT_MEMBER = re.compile(r"\(the implicit (copy|move) (constructor|assignment operator)\) not viable: "
                              r"(cannot bind reference in address space|'this' object is in address space)")
_COPY_ERROR = re.compile(r"no matching constructor for initialization of|no viable overloaded '='|"
                         r"no viable conversion from")


def _struct_copy(g) -> bool:
    return bool(_COPY_ERROR.search(g.d["msg"])) and any(_IMPLICIT_MEMBER.search(n["msg"]) for n in g.notes)


def kernel_errors(stderr: str) -> bool:
    """Whether the check pass's diagnostics hold an error Metal would report (struct copies between
    address spaces are not errors on Metal)."""
    return any(g.d["kind"] != "warning" and not _struct_copy(g) for g in _parse(stderr))


def metal_messages(stderr: str, kernel_file: str, generated_text: str, limit: int = 8) -> str:
    """Metal-worded error messages (``file:line:col: error: ...`` plus the kernel line)."""
    lines = generated_text.splitlines()

    def src(n: int) -> str:
        return lines[n - 1] if 0 < n <= len(lines) else ""

    out = []
    for g in _parse(stderr):
        if _struct_copy(g):
            continue
        d = g.d
        msg = _metal_words(d["msg"])
        if d["kind"] == "warning":
            if "'bfloat" not in msg or d["file"] != kernel_file:
                continue  # only the implicit-to-bfloat conversions are errors on Metal
        where = d if d["file"] == kernel_file else next(
            (n for n in g.notes if n["file"] == kernel_file), None)
        if where is None:
            out.append(f"error: {msg}")
            continue
        line = int(where["line"])
        msg = _reword(msg, src(line), g.notes)
        text = [f"{kernel_file}:{line}:{where['col']}: error: {msg}", f"  {line:5d} | {src(line).rstrip()}"]
        shown = 0
        for n in g.notes:
            if n is where or shown >= 4:
                continue
            if n["file"] == kernel_file:
                text.append(f"  note (line {n['line']}): {_metal_words(n['msg'])}")
                shown += 1
            elif "conflicting types" in n["msg"] or "requirement" in n["msg"] and shown == 0:
                # the first explanation from the standard library (why a template did not match)
                text.append(f"  note: {_metal_words(n['msg'])}")
                shown += 1
        out.append("\n".join(text))
        if len(out) >= limit:
            break
    if not out:
        out.append(stderr.strip()[:4000])
    return "\n".join(out)
