"""Memory measurements that the machine's load cannot change.

MLX evaluates a graph by walking it on the calling thread: each op allocates its outputs there and
hands its computation to the CPU stream's thread, up to ten ops ahead of that thread. How far ahead
the walk runs depends on how fast the stream's thread gets through its queue, that is on what else
the machine is doing, and every op queued ahead holds its outputs (and its inputs) alive: a peak
measured that way is a race with the other processes on the machine. While MLX's active memory is
above its memory limit, the walk instead waits for every queued op to finish before it goes on
(``eval_impl`` in MLX's ``transforms.cpp``). `serial_evaluation` sets the limit to one byte for the
measurement, so each op runs to completion before the next is queued and the peak is the graph's own:
the bytes it keeps alive at once.
"""

from contextlib import contextmanager

import mlx.core as mx


@contextmanager
def serial_evaluation():
    """Evaluate one op at a time inside the block (MLX's memory limit at one byte); the previous limit
    is restored on the way out."""
    mx.synchronize()
    previous = mx.set_memory_limit(1)
    try:
        yield
    finally:
        mx.synchronize()
        mx.set_memory_limit(previous)


def peak_above_active(run) -> int:
    """Bytes above the memory active before ``run()`` at the peak of ``run()`` (which evaluates what it
    builds), measured under `serial_evaluation`."""
    with serial_evaluation():
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        run()
        mx.synchronize()
        return mx.get_peak_memory() - base
