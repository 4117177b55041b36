"""metalnn.functional.rope_table.rope_cached (RoPE from cached sine/cosine tables, the CPU form of
F.rope's "auto" kernels) against mx.fast.rope: values and gradients, both of its forms (the
one-position [D, D] rotation and the table rows), far positions that make the tables grow, custom
frequencies, partial dims, interleaved pairs, half precision.

Tolerances: `kernel_cases.TOL` per dtype (float32 1e-4: the tables' sines and cosines are rounded
from float64, MLX's own are computed in float32, a few ulps apart for angles up to ~1e3 rad;
float16/bfloat16: a few roundings of 10/7-bit mantissas).
"""

import mlx.core as mx
import numpy as np
import pytest

from metalnn.functional import rope_table
from metalnn.functional.rope_table import rope_cached

from kernel_cases import mlx_rope, vjp

from kernel_cases import close, random


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("shape,dims", [((2, 3, 1, 64), 64), ((1, 2, 1, 80), 48), ((1, 1, 1, 512), 256),
                                        ((2, 2, 5, 64), 64), ((3, 7, 32), 16)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_matches_mlx_at_far_positions(shape, dims, traditional, dtype):
    freqs = mx.array(np.geomspace(1.0, 5e4, dims // 2).astype(np.float32))
    for offset in (0, 1, 255, 256, 3000):
        for f in (None, freqs):
            kw = dict(traditional=traditional, base=500000.0, scale=0.25, freqs=f)
            x = random(shape, dtype, offset)
            y = rope_cached(x, dims, offset=offset, **kw)
            assert y.dtype == dtype and y.shape == x.shape
            close(y, mlx_rope(x, dims, offset=offset, **kw), dtype)
            cot = random(shape, dtype, offset + 1)
            close(vjp(lambda v: rope_cached(v, dims, offset=offset, **kw), x, cot),
                  vjp(lambda v: mlx_rope(v, dims, offset=offset, **kw), x, cot), dtype)


def test_prefill_then_steps_equal_one_call_over_all_positions():
    x = random((1, 4, 12, 64), mx.float32, 3)
    kw = dict(traditional=False, base=10000.0, scale=1.0)
    full = rope_cached(x, 64, offset=0, **kw)
    parts = [rope_cached(x[:, :, :9], 64, offset=0, **kw)]
    parts += [rope_cached(x[:, :, t:t + 1], 64, offset=t, **kw) for t in range(9, 12)]
    close(mx.concatenate(parts, axis=2), full, mx.float32)
    close(full, mlx_rope(x, 64), mx.float32)


def test_tables_are_cached_per_setting_and_grow():
    rope_table._TABLES.clear()
    x = random((1, 2, 1, 32), mx.float32)
    kw = dict(traditional=False, base=10000.0, scale=1.0)
    rope_cached(x, 32, offset=5, **kw)
    rope_cached(x, 32, offset=6, **kw)
    assert len(rope_table._TABLES) == 1
    table = next(iter(rope_table._TABLES.values()))
    assert table.size == rope_table.MIN_POSITIONS
    rope_cached(x, 32, offset=1000, **kw)
    assert len(rope_table._TABLES) == 1 and table.size == 1024
    rope_cached(x, 32, offset=5, traditional=True, base=10000.0, scale=1.0)
    rope_cached(x, 32, offset=5, traditional=False, base=10000.0, scale=1.0, freqs=np.ones(16, np.float32))
    assert len(rope_table._TABLES) == 3


def test_bad_freqs_are_reported():
    with pytest.raises(ValueError, match="freqs must have dims / 2 = 4 values"):
        rope_cached(mx.zeros((1, 2, 8)), 8, traditional=False, base=10000.0, scale=1.0, offset=0, freqs=[1.0, 2.0])
