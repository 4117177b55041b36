"""Running the ``metalnn`` command for the command tests: in a child process (``python -m metalnn``),
or, for quick failures and help texts, in this process."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys


def metalnn_cmd(*args, input=None, timeout=300):
    """``python -m metalnn *args`` (stdin ``input``); the completed process, text captured."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "metalnn", *map(str, args)], input=input, capture_output=True,
                          text=True, timeout=timeout, env=env)


def metalnn_in_process(*args):
    """``metalnn *args`` through `metalnn.cli.main` in this process (no interpreter to start: a second
    a call saved), as `metalnn_cmd` reports it: the exit status and what went to stdout and stderr.
    An exception the command does not turn into its one-line error propagates."""
    from metalnn.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse: --help, --version, usage errors
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(["metalnn", *map(str, args)], code, out.getvalue(), err.getvalue())


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
