"""What ``import metalnn`` (and the modules ``metalnn generate`` needs) leaves out of a process.

Every command, server and worker process pays for what the package imports at start-up, in time
and in resident memory: ``hashlib`` loads libcrypto (~3.6 MiB resident), ``importlib.metadata``
brings the email and zip packages (~4 MiB), ``subprocess`` / ``tempfile`` / ``shutil`` ~1.6 MiB with
the compression modules (measured on Linux x86_64, CPython 3.11; scripts/bench_memory.py shows the
whole process). Those are imported where they are used (compiling the BLAS shim, saving files,
checking a version that differs), so a fresh interpreter that loads and runs a model has none of them.
"""

import json
import subprocess
import sys

#: modules that the load-and-generate path must not import (each imported inside the function using it)
KEPT_OUT = ("hashlib", "_hashlib", "importlib.metadata", "email", "subprocess", "tempfile", "shutil", "zipfile", "lzma")

PROBE = """
import json, sys
import metalnn
from metalnn.llm.generation import generate
from metalnn.llm.models import load_pretrained, load_tokenizer
from metalnn.cpu import fastmath
fastmath.available()
print(json.dumps(sorted(m for m in sys.modules if m in KEPT_OUT)))
"""


def test_generating_needs_none_of_the_costly_standard_modules():
    r = subprocess.run([sys.executable, "-c", f"KEPT_OUT = {KEPT_OUT!r}" + PROBE], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []
