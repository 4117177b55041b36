"""scripts/validate_metal.py: its cases cover every kernel family, and without Metal it says so."""

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import metal_kernels

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "validate_metal.py"


@pytest.fixture(scope="module")
def validate():
    import importlib.util

    spec = importlib.util.spec_from_file_location("validate_metal", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cases_cover_every_family(validate):
    assert {family for family, *_ in validate.cases()} == set(metal_kernels.families())


def test_worst_error_fails_outside_the_tolerance(validate):
    a = mx.array([1.0, 2.0])
    assert validate.worst_error([a], [a], 1e-4) == 0
    assert validate.worst_error([a + 1e-3], [a], 1e-4) > 1
    assert validate.worst_error([a * float("nan")], [a], 1e-4) == float("inf")


@pytest.mark.skipif(mx.metal.is_available(), reason="checks the message where Metal is missing")
def test_without_metal_it_says_so_and_fails():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "needs Metal" in result.stderr
