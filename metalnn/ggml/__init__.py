"""GGML's tensor types (the block formats of GGUF files), one class per type.

Each class knows its block layout (``block_size`` values in ``type_size`` bytes) and decodes blocks
with MLX ops, bit-exact with ggml's reference dequantization. `get_type` finds a class by name or GGUF
type id; `TYPES` lists them. How a packed weight is multiplied is chosen in `metalnn.functional`.
"""

from . import floats, iquants, kquants, legacy, nonlinear, ternary  # noqa: F401  (registers the types)
from .base import BY_ID, TYPES, GGMLType, get_type

__all__ = ["GGMLType", "TYPES", "BY_ID", "get_type"]
