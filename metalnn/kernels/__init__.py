"""metalnn's custom kernels (``metal_kernels/*.metal``), run by `metalnn.functional` when a
`Device`'s ``kernels`` is ``"metal"`` or ``"emulate"``.

Each module covers one family: ``supports(...)`` says whether its kernels take the given shapes
and dtypes, and one function per op launches them, wrapped in an ``mx.custom_function`` whose VJP
runs the family's backward kernels (built once per static configuration). `launch.run` runs any
kernel either through ``mx.fast.metal_kernel`` (``"metal"``) or through the CPU emulator
(``"emulate"``), from the same text. This package imports nothing from `metalnn.functional`;
arithmetic both need lives in `metalnn.kernels.op_math`.
"""
