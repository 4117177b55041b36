"""A GGUF file's tensors as MLX arrays, kept packed: no float copy of a quantized weight.

Each tensor is read from the file with bounds already checked by `read_header` (no native reader is
involved, so a malformed file can only raise `WeightLoadError`):

* F32, F16 and BF16 tensors become float arrays of their own dtype (half precision stays half);
* every block type stays as the file's blocks, ``<stem>.weight`` ``uint8 [rows, row_bytes]``, for
  `metalnn.layers.GGMLLinear` / `GGMLEmbedding` (whose native CPU kernels decode them in registers,
  2-4x faster per decoded token than MLX's affine kernels on the same bits); the returned ``packed``
  dict names their types.

For converters that regroup columns (the hybrid models), ``regroupable=True`` instead gives Q4_0,
Q4_1, Q5_0, Q5_1 and Q8_0 weights as MLX's affine layout with groups of 32, which they are exactly
(value ``= scale * q + bias``, with ``bias = -8 * d`` for Q4_0, ``-16 * d`` for Q5_0, ``-128 * d`` for
Q8_0 and the stored minimum for the ``_1`` types): ``<stem>.weight`` (uint32 bit streams),
``<stem>.scales`` and ``<stem>.biases`` (float16, exact: the file's own half values and their products
by powers of two), for `metalnn.layers.QuantizedLinear`; the other block types are decoded to float32.

Tensor shapes are row-major (``[rows, cols]``); a quantized tensor of more than two dims (stacked
experts) keeps its leading dims.

Memory: the file is never mapped, and a tensor kept as stored (floats, GGML blocks) is read straight
into its MLX array's own buffer (MLX's CPU arrays are host memory, writable through the buffer
protocol), so reading a file allocates its tensors' bytes once, and nothing else of their size.
Only the regroupable block types go through a NumPy copy of one tensor at a time.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ... import ggml
from ...errors import WeightLoadError
from .reader import GGUFHeader

#: types that are MLX's affine layout: name -> (bits, offset subtracted from the stored values or None
#: for the types with a stored minimum)
AFFINE = {"Q4_0": (4, 8), "Q4_1": (4, None), "Q5_0": (5, 16), "Q5_1": (5, None), "Q8_0": (8, 128)}
FLOATS = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


def _pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """``uint [..., k]`` values of ``bits`` bits -> ``uint32 [..., k * bits / 32]``: a little-endian bit
    stream (value ``i`` at bits ``bits*i ... bits*i + bits - 1``), MLX's affine packing."""
    q = q.astype(np.uint64).reshape(*q.shape[:-1], -1, 8)     # 8 values fill `bits` whole bytes
    word = np.zeros(q.shape[:-1], dtype=np.uint64)
    for i in range(8):
        word |= q[..., i] << np.uint64(bits * i)
    out = word[..., None].view(np.uint8)[..., :bits]            # little-endian: the low `bits` bytes
    return np.ascontiguousarray(out).reshape(*q.shape[:-2], -1).view(np.uint32)


def _affine(blocks: np.ndarray, qtype: str):
    """``uint8 [..., n_blocks, type_size]`` blocks -> (packed uint32, scales f16, biases f16)."""
    bits, offset = AFFINE[qtype]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if qtype == "Q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
    else:
        start = 2 if offset is not None else 4
        qh_at = start
        if bits == 5:
            start += 4
        lo = blocks[..., start:start + 16]
        q = np.concatenate([lo & 0xF, lo >> 4], axis=-1).astype(np.uint16)
        if bits == 5:
            qh = blocks[..., qh_at:qh_at + 4].copy().view(np.uint32)
            q |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint16)
    if offset is not None:
        with np.errstate(over="ignore"):
            bias = (-float(offset) * d.astype(np.float32)).astype(np.float16)
        if not np.all(np.isfinite(bias[np.isfinite(d)])):
            raise OverflowError("a block's bias does not fit float16")
    else:
        bias = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    packed = _pack_bits(q, bits)
    return packed.reshape(*packed.shape[:-2], -1), d, bias


def read_tensors(header: GGUFHeader, regroupable: bool = False):
    """``(arrays, packed)``: ``{name: mx.array}`` as described in the module docstring, and
    ``{weight name: GGML type name}`` for the weights kept as GGML blocks.

    Args:
        header: the file's parsed header.
        regroupable: MLX's affine layout for the types that are it, float32 for the other block types
            (``packed`` is then empty), for converters that regroup columns.

    Raises `WeightLoadError` naming the file and the tensor for a type metalnn cannot run (I8 ...
    F64, Q8_1, Q8_K: types llama.cpp never writes into model files) or a tensor whose rows are not
    whole blocks, and naming the file when it ends inside a tensor's data (it shrank since its header
    was read). Nothing read is kept when it raises.
    """
    path = header.path
    arrays, packed, bad = {}, {}, []
    with open(path, "rb") as f:
        for info in header.tensors.values():
            try:
                _read_one(f, info, arrays, packed, regroupable)
            except (KeyError, ValueError, OverflowError) as e:
                reason = e.args[0] if isinstance(e, KeyError) and e.args else e
                bad.append(f"{info.name} ({info.type} {list(info.shape)}: {reason})")
            except EOFError:
                raise WeightLoadError(source=str(path), message=(
                    f"{path}: {info.name}: the file ends inside its data")) from None
    if bad:
        raise WeightLoadError(source=str(path), message=(
            f"{path}: {len(bad)} tensor(s) cannot be read: {'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"))
    return arrays, packed


def _read_into(f, offset: int, buffer) -> None:
    """Fill the writable ``buffer`` with the file's bytes from ``offset``; EOFError when the file ends
    first."""
    view = memoryview(buffer).cast("B")
    try:
        f.seek(offset)
        done = 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise EOFError
            done += got
    finally:
        view.release()


def read_array(f, offset: int, shape: tuple, dtype) -> mx.array:
    """A new MLX array of ``shape`` and ``dtype`` holding the file's bytes from ``offset``, read into the
    array's own buffer (as a NumPy view of an MLX array shares its memory): the only copy of them made.
    EOFError when the file ends first."""
    arr = mx.zeros(shape, dtype=dtype)
    mx.eval(arr)
    if arr.nbytes:
        _read_into(f, offset, arr)
    return arr


def _read_numpy(f, info) -> np.ndarray:
    """The tensor's bytes as a NumPy ``uint8`` array (for the conversions done in NumPy)."""
    raw = np.empty(info.nbytes, dtype=np.uint8)
    if info.nbytes:
        _read_into(f, info.offset, raw)
    return raw


def _check_shape(shape: tuple, row_bytes: int, nbytes: int):
    """ValueError unless ``shape``'s rows of ``row_bytes`` are the header's ``nbytes`` (the header's count
    is an int64 product, which a corrupt file can overflow) and every dim fits MLX's (int32) shapes."""
    if any(d >= 2**31 for d in shape):
        raise ValueError("a dim of 2**31 or more")
    if math.prod(shape[:-1]) * row_bytes != nbytes:
        raise ValueError(f"its shape is not its {nbytes} bytes")


def _read_one(f, info, arrays, packed, regroupable):
    name, shape = info.name, tuple(info.shape)
    if info.type in FLOATS:
        _check_shape(shape, (shape[-1] if shape else 1) * FLOATS[info.type].size, info.nbytes)
        arrays[name] = read_array(f, info.offset, shape, FLOATS[info.type])
        return
    qtype = ggml.get_type(info.type)
    if not shape or shape[-1] % qtype.block_size:
        raise ValueError(f"rows of {shape[-1] if shape else 0} values are not whole {qtype.block_size}-value blocks")
    stem = name[:-len(".weight")] if name.endswith(".weight") else name
    row_bytes = qtype.row_bytes(shape[-1])
    _check_shape(shape, row_bytes, info.nbytes)
    if info.type in AFFINE and regroupable:
        blocks = _read_numpy(f, info).reshape(*shape[:-1], row_bytes // qtype.type_size, qtype.type_size)
        w, scales, biases = _affine(blocks, info.type)
        arrays[f"{stem}.weight"] = mx.array(w)
        arrays[f"{stem}.scales"] = mx.array(scales)
        arrays[f"{stem}.biases"] = mx.array(biases)
        return
    data = read_array(f, info.offset, (*shape[:-1], row_bytes), mx.uint8)
    if regroupable:
        arrays[name] = qtype.decode(data)
        return
    arrays[f"{stem}.weight"] = data
    packed[f"{stem}.weight"] = info.type
