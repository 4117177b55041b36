"""Tests of metalnn's native CPU code: on the platform the extension is built for (Linux x86_64) a
missing extension is a failed install and fails the test; elsewhere the test does not apply."""

import platform
import sys

import pytest

NATIVE_PLATFORM = sys.platform.startswith("linux") and platform.machine() == "x86_64"


def require_native(available: bool, what: str = "the native extension") -> None:
    """Fail (on Linux x86_64) or skip (elsewhere) unless ``available``."""
    if available:
        return
    from metalnn.cpu import native_ext

    why = native_ext.unavailable_reason() or "loaded, but without this primitive"
    if NATIVE_PLATFORM:
        pytest.fail(f"{what} is unavailable on the platform it is built for: {why}")
    pytest.skip(f"{what} does not run on this platform ({why})")
