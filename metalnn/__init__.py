"""metalnn: build, train and run neural networks on Apple Silicon through MLX.

On Linux, MLX's matrix products run on an optimized BLAS whatever is imported first: the package
installs a startup hook that loads OpenBLAS when ``mlx`` is first imported (see `metalnn.cpu.blas`).
"""

from .cpu import blas as _blas

_blas.setup()

from . import functional, init, losses, optimizers  # noqa: E402
from .data import Data, MTLSize  # noqa: E402
from .device import Device, default_device, set_default_device  # noqa: E402
from .errors import (MetalnnError, ShapeError, TrainingDivergedError, UnsupportedConfigError,  # noqa: E402
                     WeightLoadError)
from .layers import *  # noqa: E402,F401,F403
from .layers import __all__ as _layer_names  # noqa: E402
from .trainer import Trainer  # noqa: E402
from .llm.generation import generate, stream_generate  # noqa: E402
from .llm.sampling import SamplingParams, sample_logits  # noqa: E402
from .llm import models  # noqa: E402
from .llm.tuner import datasets, lora  # noqa: E402
from .quantization import QuantizationSummary, quantize  # noqa: E402
from .weights import load_safetensors, open_provider, save_safetensors  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Data", "MTLSize", "Device", "default_device", "set_default_device", "MetalnnError", "ShapeError",
    "TrainingDivergedError", "UnsupportedConfigError", "WeightLoadError", "Trainer", "functional", "init", "losses",
    "optimizers",
    "load_safetensors", "open_provider", "save_safetensors", "generate", "stream_generate", "sample_logits",
    "SamplingParams",
    "models", "lora", "datasets", "quantize", "QuantizationSummary", *_layer_names,
]
