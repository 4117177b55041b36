"""metalnn's layers. Every one is a `metalnn.Layer` (an ``mlx.nn.Module``) with ``compile(device, data)``."""

from .activations import GELU, LeakyReLU, ReLU, Sigmoid, SiLU, Tanh, activation
from .attention import CachedLayer, GPT2Attention, KVCache, SelfAttention
from .containers import Parallel, Sequential
from .conv import Conv1D, Conv2D, Conv3D, ConvTransposed1D, ConvTransposed2D, ConvTransposed3D
from .dropout import Dropout
from .embedding import Embeddings
from .kmeans import KMeans
from .linear import Linear, LinearWithWeights, MulRows
from .mlp import MLP, GPT2MLP, SwiGluFfn
from .norm import LayerNorm, RMSNorm
from .pooling import AvgPool2D, GlobalAvgPool, MaxPool2D
from .recurrent import GRU, LSTM, RNN
from .residual import Residual
from .shape import Flatten, Identity, Reshape
from .softmax import Softmax
from .swiglu import SwiGLU
from .transformer import GPT2Block, TransformerBlock

__all__ = [
    "GELU", "LeakyReLU", "ReLU", "Sigmoid", "SiLU", "Tanh", "activation", "Dropout", "Embeddings", "Linear",
    "LinearWithWeights", "MulRows", "LayerNorm", "RMSNorm", "Residual", "Flatten", "Identity", "Reshape", "SwiGLU",
    "CachedLayer", "GPT2Attention", "KVCache", "SelfAttention", "MLP", "GPT2MLP", "SwiGluFfn", "GPT2Block",
    "TransformerBlock", "Parallel", "Sequential", "KMeans", "GRU", "LSTM", "RNN", "Softmax",
]
__all__ += ["Conv1D", "Conv2D", "Conv3D", "ConvTransposed1D", "ConvTransposed2D", "ConvTransposed3D",
            "MaxPool2D", "AvgPool2D", "GlobalAvgPool"]
from .gated_deltanet import GatedDeltaCache, GatedDeltaNet  # noqa: E402

__all__ += ["GatedDeltaCache", "GatedDeltaNet"]
