"""Metal kernel sources of metalnn, and the CPU emulator that runs them (`metal_kernels.emulator`).

Each ``<family>.metal`` file holds one family of kernels as ``mx.fast.metal_kernel`` wants them: an
optional shared header, then one or more kernel *bodies* (MLX writes each function's signature from
the input and output names). Sections are marked with comment lines::

    // @header
    ... helpers shared by the family ...
    // @kernel rms_norm_forward
    // @inputs x, w, eps, axis_size
    // @outputs y
    ... body ...

`load(family)` parses a file into a `KernelFamily`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class KernelSource:
    """One kernel: its name, input and output names (in order) and body text."""

    name: str
    inputs: tuple
    outputs: tuple
    body: str
    header: str = ""


@dataclass
class KernelFamily:
    name: str
    path: Path
    header: str
    kernels: dict = field(default_factory=dict)

    def __getitem__(self, name) -> KernelSource:
        try:
            return self.kernels[name]
        except KeyError:
            raise KeyError(f"{self.path.name} has no kernel {name!r}; it has {sorted(self.kernels)}") from None


_MARK = re.compile(r"^\s*//\s*@(header|kernel|inputs|outputs)\b\s*(.*)$")


def parse(text: str, family: str = "<text>", path: Path | None = None) -> KernelFamily:
    """Parse the sectioned text of a ``.metal`` family file."""
    header_lines, kernels = [], {}
    current, section = None, None
    for lineno, line in enumerate(text.splitlines(), 1):
        m = _MARK.match(line)
        if m:
            tag, rest = m.group(1), m.group(2).strip()
            if tag == "header":
                section = "header"
                continue
            if tag == "kernel":
                if not rest or rest in kernels:
                    raise ValueError(f"{family}:{lineno}: kernel needs a unique name, got {rest!r}")
                current = {"name": rest, "inputs": None, "outputs": None, "body": []}
                kernels[rest] = current
                section = "kernel"
                continue
            if current is None:
                raise ValueError(f"{family}:{lineno}: @{tag} before any @kernel")
            current[tag] = tuple(n.strip() for n in rest.split(",") if n.strip())
            continue
        if section == "header":
            header_lines.append(line)
        elif section == "kernel":
            current["body"].append(line)
    header = "\n".join(header_lines).strip("\n")
    fam = KernelFamily(family, path or Path(family), header)
    for name, k in kernels.items():
        if k["inputs"] is None or k["outputs"] is None:
            raise ValueError(f"{family}: kernel {name} needs @inputs and @outputs lines")
        fam.kernels[name] = KernelSource(name, k["inputs"], k["outputs"], "\n".join(k["body"]).strip("\n") + "\n",
                                         header)
    return fam


@lru_cache(maxsize=None)
def load(family: str) -> KernelFamily:
    """Parse ``metal_kernels/<family>.metal``."""
    path = SOURCE_DIR / f"{family}.metal"
    if not path.exists():
        raise FileNotFoundError(f"no kernel family {family!r} (looked for {path})")
    return parse(path.read_text(), family, path)


def families() -> list:
    return sorted(p.stem for p in SOURCE_DIR.glob("*.metal"))
