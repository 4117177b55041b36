import pytest

from metal_kernels.emulator import _compiler

_NEEDS_CLANG = ("test_kernels.py", "test_checks.py")


def pytest_collection_modifyitems(config, items):
    try:
        _compiler.find_compiler()
    except _compiler.CompilerNotFound as e:
        skip = pytest.mark.skip(reason=str(e))
        for item in items:
            if item.fspath.basename in _NEEDS_CLANG:
                item.add_marker(skip)
