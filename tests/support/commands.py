"""Running the ``metalnn`` command in a child process (``python -m metalnn``) for the command tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def metalnn_cmd(*args, input=None, timeout=300):
    """``python -m metalnn *args`` (stdin ``input``); the completed process, text captured."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "metalnn", *map(str, args)], input=input, capture_output=True,
                          text=True, timeout=timeout, env=env)


def assert_one_line_error(result, *mentions):
    """Exit status 1 and one error line ``metalnn COMMAND: error: ...`` naming every ``mentions``
    (a ``[loaded ...]`` line may come first), no traceback."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 or (len(lines) == 2 and lines[0].startswith("[")), result.stderr
    assert re.match(r"metalnn \w+: error: ", lines[-1]), lines[-1]
    for m in mentions:
        assert m in lines[-1], (m, lines[-1])
