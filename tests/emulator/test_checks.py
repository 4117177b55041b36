"""Planted bugs the emulator must report (and the fixed kernels it must accept)."""

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels.emulator import EmulatorError, metal_kernel

ORDERS = ["forward", "reversed", "shuffled"]

REVERSE_TEMPLATE = """
    uint lid = thread_index_in_threadgroup;
    uint gid = thread_position_in_grid.x;
    threadgroup float buf[64];
    buf[lid] = x[gid];
    {BARRIER}
    out[gid] = buf[63 - lid];
"""


def run(k, x, n_out, grid, tg, order="forward", **kw):
    return k(inputs=[x], output_shapes=[(n_out,)], output_dtypes=[mx.float32], grid=grid,
             threadgroup=tg, lane_order=order, **kw)[0]


@pytest.mark.parametrize("order", ORDERS)
def test_missing_barrier_is_reported(order):
    x = np.arange(128, dtype=np.float32)
    good = metal_kernel("rev_ok", ["x"], ["out"],
                        REVERSE_TEMPLATE.replace("{BARRIER}", "threadgroup_barrier(mem_flags::mem_threadgroup);"))
    o = run(good, x, 128, (128, 1, 1), (64, 1, 1), order)
    np.testing.assert_array_equal(o, x.reshape(2, 64)[:, ::-1].reshape(-1))
    bad = metal_kernel("rev_bad", ["x"], ["out"], REVERSE_TEMPLATE.replace("{BARRIER}", ""))
    with pytest.raises(EmulatorError) as e:
        run(bad, x, 128, (128, 1, 1), (64, 1, 1), order)
    msg = str(e.value)
    assert "rev_bad" in msg and "thread_position_in_grid=(" in msg
    # forward: the reader runs before the writer -> never-written memory;
    # reversed: the writer ran first without a barrier in between -> race
    assert "uninitialised threadgroup memory" in msg or "race" in msg
    assert "'buf'" in msg


TREE = """
    uint lid = thread_index_in_threadgroup;
    threadgroup float s[64];
    s[lid] = x[thread_position_in_grid.x];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint stride = 32; stride > 0; stride >>= 1) {
        if (lid < stride) s[lid] += s[lid + stride];
        {BARRIER}
    }
    if (lid == 0) out[threadgroup_position_in_grid.x] = s[0];
"""


@pytest.mark.parametrize("order", ORDERS)
def test_race_in_tree_reduction(order):
    x = np.random.default_rng(0).standard_normal(128).astype(np.float32)
    good = metal_kernel("tree_ok", ["x"], ["out"],
                        TREE.replace("{BARRIER}", "threadgroup_barrier(mem_flags::mem_threadgroup);"))
    o = run(good, x, 2, (128, 1, 1), (64, 1, 1), order)
    np.testing.assert_allclose(o, x.reshape(2, 64).sum(1), rtol=1e-5)
    bad = metal_kernel("tree_bad", ["x"], ["out"], TREE.replace("{BARRIER}", ""))
    with pytest.raises(EmulatorError, match=r"threadgroup memory race.*'s'"):
        run(bad, x, 2, (128, 1, 1), (64, 1, 1), order)


def test_device_memory_race():
    # thread i reads out[i + 1], which thread i + 1 writes: unordered accesses to device memory
    k = metal_kernel("dev_race", ["x"], ["out"], """
        uint i = thread_position_in_grid.x;
        out[i] = x[i];
        if (i + 1 < 32) out[i] += out[i + 1];
    """)
    x = np.ones(32, np.float32)
    # the reader runs first: thread 1's write finds thread 0's read
    with pytest.raises(EmulatorError, match=r"kernel 'dev_race', thread_position_in_grid=\(1, 0, 0\).*device memory "
                       r"race: writes element 1 \(4-byte elements\) of output 'out', read by thread \(0, 0, 0\) of "
                       r"this threadgroup with no threadgroup_barrier\(mem_flags::mem_device\)"):
        run(k, x, 32, (32, 1, 1), (32, 1, 1), "forward")
    # the writer runs first: thread 30's read finds thread 31's write
    with pytest.raises(EmulatorError, match=r"thread_position_in_grid=\(30, 0, 0\).*reads element 31 .* written by "
                       r"thread \(31, 0, 0\)"):
        run(k, x, 32, (32, 1, 1), (32, 1, 1), "reversed")
    # unchecked, the answer depends on the order
    fwd = run(k, x, 32, (32, 1, 1), (32, 1, 1), "forward", check_races=False)
    rev = run(k, x, 32, (32, 1, 1), (32, 1, 1), "reversed", check_races=False)
    assert np.isnan(fwd[:31]).all()  # read the poisoned, not yet written, neighbour
    assert not np.isnan(rev).any()


def test_device_memory_barrier_and_threadgroups():
    # a threadgroup_barrier with mem_device orders device memory inside a threadgroup ...
    src = """
        uint i = thread_position_in_grid.x;
        uint lid = thread_index_in_threadgroup;
        tmp[i] = x[i];
        threadgroup_barrier(FLAGS);
        out[i] = tmp[i] + tmp[i - lid + (lid + 1) % 32];
    """
    x = np.arange(64, dtype=np.float32)

    def run2(k, order):
        return k(inputs=[x], output_shapes=[(64,), (64,)], output_dtypes=[mx.float32] * 2, grid=(64, 1, 1),
                 threadgroup=(32, 1, 1), lane_order=order)[1]

    ok = metal_kernel("dev_barrier", ["x"], ["tmp", "out"], src.replace("FLAGS", "mem_flags::mem_device"))
    o = run2(ok, "shuffled")
    np.testing.assert_array_equal(o.reshape(2, 32), x.reshape(2, 32) + np.roll(x.reshape(2, 32), -1, axis=1))
    bad = metal_kernel("dev_barrier_tg", ["x"], ["tmp", "out"], src.replace("FLAGS", "mem_flags::mem_threadgroup"))
    with pytest.raises(EmulatorError, match=r"device memory race: reads element 1 .* of output 'tmp', written by "
                       r"thread \(1, 0, 0\) of this threadgroup"):
        run2(bad, "forward")
    # a write after the thread's own read still sees another thread's unordered read
    racy = metal_kernel("dev_reread", ["x"], ["tmp", "out"], src.replace("FLAGS", "mem_flags::mem_device") +
                        "tmp[i] = 0.0f;")
    with pytest.raises(EmulatorError, match=r"device memory race: writes element \d+ .* of output 'tmp', read by"):
        run2(racy, "forward")
    # ... but nothing orders two threadgroups of one dispatch
    cross = metal_kernel("dev_cross", ["x"], ["out"], """
        uint i = thread_position_in_grid.x;
        out[i % 32] = x[i];
    """)
    with pytest.raises(EmulatorError, match=r"thread_position_in_grid=\(32, 0, 0\).*device memory race: writes element 0 "
                       r".* written by thread \(0, 0, 0\) of another threadgroup; threadgroups of one dispatch are "
                       r"never ordered"):
        run(cross, x, 32, (64, 1, 1), (32, 1, 1))
    # threads that all store the same value are not reported (a store of the value already there
    # looks like a read)
    same = metal_kernel("dev_same", ["x"], ["out"], "out[0] = 7.0f;")
    assert run(same, x, 1, (64, 1, 1), (32, 1, 1))[0] == 7.0


def test_out_of_bounds_write():
    k = metal_kernel("oob", ["x"], ["out"], """
        uint i = thread_position_in_grid.x;
        out[i] = x[i % 10] * 2;
    """)
    x = np.ones(10, np.float32)
    run(k, x, 12, (12, 1, 1), (4, 1, 1))  # fits
    with pytest.raises(EmulatorError) as e:
        run(k, x, 10, (12, 1, 1), (4, 1, 1))
    msg = str(e.value)
    assert "out-of-bounds" in msg and "'out'" in msg and "element index 10" in msg
    assert "kernel 'oob'" in msg and "thread_position_in_grid=(10, 0, 0)" in msg


def test_out_of_bounds_read_negative_and_through_derived_pointer():
    k = metal_kernel("oob_read", ["x"], ["out"], """
        uint i = thread_position_in_grid.x;
        const device float* row = x + 4 * i;
        out[i] = row[-1 + (i == 0 ? 0 : 1)];
    """)
    x = np.ones(16, np.float32)
    with pytest.raises(EmulatorError, match=r"out-of-bounds access to device buffer 'x': element index -1"):
        run(k, x, 4, (4, 1, 1), (4, 1, 1))


def test_out_of_bounds_threadgroup_array():
    k = metal_kernel("oob_tg", ["x"], ["out"], """
        uint lid = thread_index_in_threadgroup;
        threadgroup float t[32];
        t[lid] = x[lid];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[lid] = t[lid];
    """)
    with pytest.raises(EmulatorError, match=r"thread_position_in_grid=\(32, 0, 0\).*threadgroup array 't': element index 32 "):
        run(k, np.ones(64, np.float32), 64, (64, 1, 1), (64, 1, 1))


def test_uninitialised_threadgroup_read():
    k = metal_kernel("uninit", ["x"], ["out"], """
        uint lid = thread_index_in_threadgroup;
        threadgroup float t[64];
        if (lid < 32) t[lid] = x[lid];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[lid] = t[lid] + t[(lid + 1) % 32];
    """)
    for order in ORDERS:
        with pytest.raises(EmulatorError, match=r"uninitialised threadgroup memory: threadgroup array 't'.*element (3[2-9]|[4-6]\d)\) was never written"):
            run(k, np.ones(64, np.float32), 64, (64, 1, 1), (64, 1, 1), order)


def test_divergent_barrier():
    k = metal_kernel("divbar", ["x"], ["out"], """
        uint lid = thread_index_in_threadgroup;
        threadgroup float t[64];
        t[lid] = x[lid];
        if (lid < 16) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
        } else {
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        out[lid] = t[63 - lid];
    """)
    with pytest.raises(EmulatorError, match="divergent threadgroup_barrier"):
        run(k, np.ones(64, np.float32), 64, (64, 1, 1), (64, 1, 1))


def test_barrier_after_early_return():
    k = metal_kernel("early", ["x"], ["out"], """
        uint gid = thread_position_in_grid.x;
        uint lid = thread_index_in_threadgroup;
        threadgroup float t[32];
        if (gid >= 40) return;
        t[lid] = x[gid];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[gid] = t[31 - lid];
    """)
    # grid of 64 in threadgroups of 32: threads 40..63 return before the barrier
    with pytest.raises(EmulatorError, match=r"not reached by every thread.*exited"):
        run(k, np.ones(64, np.float32), 64, (64, 1, 1), (32, 1, 1))
    # a grid that is an exact fit never takes the early return
    o = run(k, np.arange(64, dtype=np.float32), 40, (32, 1, 1), (32, 1, 1))
    np.testing.assert_array_equal(o[:32], np.arange(32)[::-1])


def test_simd_op_in_divergent_lanes():
    k = metal_kernel("divsimd", ["x"], ["out"], """
        uint lane = thread_index_in_simdgroup;
        float v = x[thread_position_in_grid.x];
        if (lane < 16) v = simd_sum(v);
        out[thread_position_in_grid.x] = simd_broadcast(v, 0);
    """)
    with pytest.raises(EmulatorError, match=r"SIMD operation simd_sum.*lanes \{0,1,2.*15\}.*lane 16 at simd_broadcast"):
        run(k, np.ones(32, np.float32), 32, (32, 1, 1), (32, 1, 1))


def test_simd_op_before_exit_needs_strict_mode():
    # lanes that skip the op and then exit look like lanes that exited before
    # it (which Metal allows): only strict_simd reports this one
    k = metal_kernel("divsimd2", ["x"], ["out"], """
        uint lane = thread_index_in_simdgroup;
        float v = x[thread_position_in_grid.x];
        if (lane < 16) v = simd_sum(v);
        out[thread_position_in_grid.x] = v;
    """)
    o = run(k, np.ones(32, np.float32), 32, (32, 1, 1), (32, 1, 1))
    np.testing.assert_array_equal(o, [16.0] * 16 + [1.0] * 16)
    with pytest.raises(EmulatorError, match=r"SIMD operation simd_sum.*lane 16 exited"):
        run(k, np.ones(32, np.float32), 32, (32, 1, 1), (32, 1, 1), strict_simd=True)


def test_simd_ops_after_early_exit_use_remaining_lanes():
    # lanes that returned are inactive: the sum covers the lanes still running
    k = metal_kernel("exitsimd", ["x"], ["out"], """
        uint i = thread_position_in_grid.x;
        if (i >= 20) return;
        float s = simd_sum(x[i]);
        out[i] = s;
    """)
    o = run(k, np.ones(32, np.float32), 20, (32, 1, 1), (32, 1, 1))
    np.testing.assert_array_equal(o, 20.0)


def test_different_simd_ops_in_one_simdgroup():
    k = metal_kernel("twosimd", ["x"], ["out"], """
        uint lane = thread_index_in_simdgroup;
        float v = x[lane];
        v = (lane % 2) ? simd_max(v) : simd_min(v);
        out[lane] = v;
    """)
    with pytest.raises(EmulatorError, match=r"SIMD operation simd_(max|min).*(lane 1 at simd_max|lane 0 at simd_min)"):
        run(k, np.ones(32, np.float32), 32, (32, 1, 1), (32, 1, 1))


def test_threadgroup_memory_limit():
    k = metal_kernel("bigtg", ["x"], ["out"], """
        threadgroup float t[9000];
        t[thread_index_in_threadgroup] = x[0];
        out[0] = 1;
    """)
    with pytest.raises(EmulatorError, match="exceeds 32 KiB"):
        run(k, np.ones(1, np.float32), 1, (1, 1, 1), (1, 1, 1))


def test_error_is_not_sticky():
    k = metal_kernel("sticky", ["x"], ["out"], "uint i = thread_position_in_grid.x; out[i] = x[i];")
    with pytest.raises(EmulatorError, match="out-of-bounds access to device buffer 'x'"):
        run(k, np.ones(4, np.float32), 4, (8, 1, 1), (8, 1, 1))
    np.testing.assert_array_equal(run(k, np.ones(8, np.float32), 8, (8, 1, 1), (8, 1, 1)), 1.0)
