"""Custom-kernel implementations of metalnn's ops (``device.kernels`` in ``"metal"``, ``"emulate"``).

Each module wraps kernels from ``metal_kernels/<family>.metal`` with ``mx.custom_function`` and a
VJP that runs the family's backward kernels. `launch.Kernel` runs a kernel either through
``mx.fast.metal_kernel`` (``metal``) or through the CPU emulator (``emulate``), from the same text.
"""
