"""Write the kernel text exactly as MLX 0.32 does for ``mx.fast.metal_kernel``.

MLX puts its prelude (``kernels/utils.h``) in front when it builds the library;
that part is not in this text (the emulator supplies metal_stdlib.hpp instead).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The MLX releases whose `write_signature` this module reproduces (MLX's kernel text changes between
# minor releases: a kernel that runs here must compile on the user's MLX).
SUPPORTED_MLX = ((0, 32),)

# fewer elements than this: the input is passed in the `constant` address space
MAX_CONSTANT_ARRAY_SIZE = 8


def check_mlx_version(installed: str | None = None) -> None:
    """Raise RuntimeError when the installed mlx writes kernel text this module does not reproduce.

    ``installed`` defaults to the installed ``mlx`` distribution's version; no mlx installed is fine
    (the emulator itself runs on numpy).
    """
    if installed is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("mlx")
        except PackageNotFoundError:
            return
    m = re.match(r"(\d+)\.(\d+)", installed)
    if not m or (int(m.group(1)), int(m.group(2))) not in SUPPORTED_MLX:
        want = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_MLX)
        raise RuntimeError(
            f"the Metal emulator writes kernel signatures as mlx {want} does, but mlx {installed} is "
            f"installed: its kernel text may differ, so emulated results would not carry over to "
            f"Metal. Install mlx {want} (pip install 'mlx[cpu]>=0.32.4,<0.33' on Linux)")

# MLX's list, in its order (alphabetical), with the declared type
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]


@dataclass(frozen=True)
class ArgInfo:
    """What the generated signature says about one input (as seen by the launcher)."""

    type_str: str
    size: int
    ndim: int


@dataclass
class Param:
    """One parameter of the generated kernel, in buffer order."""

    kind: str  # "ptr" | "ref" | "attr"
    type_str: str  # element type for ptr/ref; uint/uint3 for attr
    name: str
    source: tuple = ()  # ("input", i) | ("shape", i) | ("strides", i) | ("ndim", i) | ("output", i)


def shape_infos(input_names, source):
    return [
        (f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
        for n in input_names
    ]


def attributes(source):
    return [(a, t) for a, t in METAL_ATTRIBUTES if a in source]


def template_def(template_args, type_string):
    parts = []
    for _, v in template_args:
        if isinstance(v, bool):
            parts.append("1" if v else "0")  # std::ostream prints a bool as 1/0
        elif isinstance(v, int):
            parts.append(str(v))
        else:
            parts.append(type_string(v))
    return "<" + ", ".join(parts) + ">"


def kernel_name(name, template_args, inputs: list[ArgInfo], output_types, type_string):
    kname = "custom_kernel_" + name
    if template_args:
        tdef = template_def(template_args, type_string)
        h = re.sub(r"<|>|(, )", "_", tdef)[:-1]
        kname += "_" + h
    for a in inputs:
        kname += "_" + a.type_str
        if a.ndim == 0:
            kname += "s"
        elif a.size < MAX_CONSTANT_ARRAY_SIZE:
            kname += "c"
    for t in output_types:
        kname += "_" + t
    return kname


def write_signature(
    func_name,
    header,
    source,
    input_names,
    inputs: list[ArgInfo],
    output_names,
    output_types,
    template_args,
    attrs,
    sinfos,
    atomic_outputs,
):
    """Return (kernel text, parameter list) following MLX's write_signature."""
    params: list[Param] = []
    out = [header]
    if template_args:
        decl = []
        for tname, v in template_args:
            if isinstance(v, bool):
                t = "bool"
            elif isinstance(v, int):
                t = "int"
            else:
                t = "typename"
            decl.append(f"{t} {tname}")
        out.append("template <" + ", ".join(decl) + ">\n")
    out.append(f"[[kernel]] void {func_name}(\n")
    index = 0
    for i, (name, arr) in enumerate(zip(input_names, inputs)):
        location = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arr.ndim == 0 else "*"
        out.append(f"  const {location} {arr.type_str}{ref} {name} [[buffer({index})]],\n")
        params.append(Param("ref" if arr.ndim == 0 else "ptr", arr.type_str, name, ("input", i)))
        index += 1
        if arr.ndim > 0:
            has_shape, has_strides, has_ndim = sinfos[i]
            if has_shape:
                out.append(f"  const constant int* {name}_shape [[buffer({index})]],\n")
                params.append(Param("ptr", "int", f"{name}_shape", ("shape", i)))
                index += 1
            if has_strides:
                out.append(f"  const constant int64_t* {name}_strides [[buffer({index})]],\n")
                params.append(Param("ptr", "int64_t", f"{name}_strides", ("strides", i)))
                index += 1
            if has_ndim:
                out.append(f"  const constant int& {name}_ndim [[buffer({index})]],\n")
                params.append(Param("ref", "int", f"{name}_ndim", ("ndim", i)))
                index += 1
    for i, (name, t) in enumerate(zip(output_names, output_types)):
        tt = f"atomic<{t}>" if atomic_outputs else t
        out.append(f"  device {tt}* {name} [[buffer({index})]]")
        params.append(Param("ptr", tt, name, ("output", i)))
        # (sic) MLX compares the buffer index with #inputs + #outputs - 1
        if index < len(inputs) + len(output_names) - 1 or len(attrs) > 0:
            out.append(",\n")
        else:
            out.append(") {\n")
        index += 1
    for j, (a, t) in enumerate(attrs):
        out.append(f"  {t} {a} [[{a}]]")
        params.append(Param("attr", t, a))
        out.append(",\n" if j < len(attrs) - 1 else ") {\n")
    out.append(source)
    out.append("\n}\n")
    return "".join(out), params


def instantiation(func_name, template_args, type_string):
    tdef = func_name + template_def(template_args, type_string)
    return f'\ntemplate [[host_name("{func_name}")]] [[kernel]] decltype({tdef}) {tdef};\n'
