"""The Linux CPU backend: what makes MLX's CPU path fast. Private: only `metalnn.functional` (and this
package itself) imports it; layers, losses and optimizers reach it through `metalnn.functional`.

* `blas`, `blas_hook`: OpenBLAS for MLX's matrix products (a forwarding shim and a startup hook);
  `blas_libs` finds the library (NumPy's own, so both share one thread pool, else scipy-openblas32's),
  `blas_threads` sets the shim's thread governor (OpenBLAS threads from the cores left free);
* `native_ext`: loads the native extension ``metalnn.cpu._fastmath`` (built from ``native/fastmath``)
  when it matches the installed MLX;
* `fastmath` (element-wise maps), `fused` (fused training primitives), `im2col` (convolution
  gathers), `qmatmul` (quantized products): the extension's ops, each with an MLX fallback.

This package's ``__init__`` imports nothing: `blas` must load before ``mlx.core`` does.
Nothing here is loaded on macOS, where MLX's Metal and Accelerate back ends serve these ops.
"""
