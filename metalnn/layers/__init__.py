"""metalnn's layers. Every one is a `metalnn.Layer` (an ``mlx.nn.Module``) with ``compile(device, data)``."""

from .base import Layer, Layers, Sequential, checkpoint_blocks
from .adaptive_softmax import AdaptiveSoftmax, AdaptiveSoftmaxOutput
from .activations import GELU, Activation, LeakyReLU, ReLU, Sigmoid, SiLU, Tanh, activation
from .attention import KVCache, SelfAttention
from .containers import Parallel
from .conv import Conv1D, Conv2D, Conv3D, ConvTransposed1D, ConvTransposed2D, ConvTransposed3D
from .dropout import Dropout
from .embedding import Embedding
from .fused_projections import FusedGateUpMLP, FusedQKVAttention, LongRoPE
from .gated_deltanet import GatedDeltaCache, GatedDeltaNet
from .state_cache import StateCache
from .ggml import GGMLEmbedding, GGMLLinear
from .kmeans import KMeans
from .mamba2 import Mamba2, Mamba2Cache
from .linear import Linear, LinearWithWeights, MulRows
from .mlp import MLP, SwiGLU
from .latent_attention import LatentAttention
from .moe import SparseMoE, SwitchGLU, SwitchMLP, load_balancing_loss
from .norm import GatedRMSNorm, GroupedGatedRMSNorm, LayerNorm, RMSNorm
from .pooling import AvgPool2D, GlobalAvgPool, MaxPool2D
from .quantized import QuantizedEmbedding, QuantizedLinear
from .recurrent import GRU, LSTM, RNN
from .residual import Residual
from .shape import Flatten, Identity, Reshape
from .sigmoid_moe import GroupLimitedMoE, SigmoidRouter
from .short_conv import ShortConv, ShortConvCache
from .softmax import Softmax
from .transformer import DecoderBlock, SandwichBlock, TransformerBlock

__all__ = [
    "Layer", "Layers", "Sequential", "checkpoint_blocks",
    "Activation", "GELU", "LeakyReLU", "ReLU", "Sigmoid", "SiLU", "Tanh", "activation",
    "Linear", "LinearWithWeights", "MulRows", "Embedding", "QuantizedLinear", "QuantizedEmbedding", "GGMLLinear",
    "GGMLEmbedding",
    "Flatten", "Identity", "Reshape",
    "Dropout", "GatedRMSNorm", "GroupedGatedRMSNorm", "LayerNorm", "RMSNorm",
    "Parallel", "Residual",
    "MLP", "SwiGLU", "SparseMoE", "SwitchGLU", "SwitchMLP", "load_balancing_loss", "GroupLimitedMoE", "SigmoidRouter",
    "LatentAttention",
    "KVCache", "SelfAttention", "DecoderBlock", "SandwichBlock", "TransformerBlock", "GatedDeltaCache", "StateCache",
    "GatedDeltaNet", "Mamba2", "Mamba2Cache", "FusedQKVAttention", "FusedGateUpMLP", "LongRoPE", "ShortConv",
    "ShortConvCache",
    "Conv1D", "Conv2D", "Conv3D", "ConvTransposed1D", "ConvTransposed2D", "ConvTransposed3D",
    "AvgPool2D", "GlobalAvgPool", "MaxPool2D",
    "GRU", "LSTM", "RNN", "KMeans", "Softmax", "AdaptiveSoftmax", "AdaptiveSoftmaxOutput",
]
