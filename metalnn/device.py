"""`Device`: where metalnn runs and which kernel implementation its custom ops use."""

from __future__ import annotations

import copy
import os

import mlx.core as mx

KERNEL_CHOICES = ("auto", "metal", "reference", "emulate")


def metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:  # pragma: no cover - very old MLX
        return False


class Device:
    """Run settings shared by every layer compiled on it: the implementation of metalnn's custom
    ops and the random key (dropout, sampling). Training mode is the model's (``model.train()`` /
    ``model.eval()``, as in mlx.nn), not the device's.

    Args:
        kernels: ``"metal"`` (custom Metal kernels via ``mx.fast.metal_kernel``), ``"reference"``
            (plain MLX ops), ``"emulate"`` (the Metal source run by the CPU emulator; slow, for
            testing), or ``"auto"`` (``metal`` when Metal is available, else ``reference``). The
            environment variable ``METALNN_KERNELS`` overrides the argument.
        seed: seed of the device's random key (dropout, sampling).
        stream: an MLX device or stream to run on (default: MLX's default device).
        emulator_options: extra keywords for the emulator on the ``emulate`` path, e.g.
            ``{"lane_order": "shuffled", "seed": 1}`` to shake out races.
    """

    def __init__(self, kernels: str = "auto", seed: int = 0, stream=None, emulator_options: dict | None = None):
        requested = os.environ.get("METALNN_KERNELS", "").strip().lower() or kernels
        if requested not in KERNEL_CHOICES:
            raise ValueError(f"Device: kernels must be one of {KERNEL_CHOICES}, got {requested!r}")
        if requested == "auto":
            requested = "metal" if metal_available() else "reference"
        if requested == "metal" and not metal_available():
            raise RuntimeError("Device: kernels='metal' needs Metal (macOS on Apple Silicon); "
                               "use 'reference' or 'emulate' here")
        self.kernels = requested
        self.stream = stream if stream is not None else mx.default_device()
        self.emulator_options = dict(emulator_options or {})
        # A list so mx.compile can track it as state (see Trainer).
        self.rng_state = [mx.random.key(seed)]

    def next_key(self):
        """Split the device key; return a fresh key for one random draw."""
        key, sub = mx.random.split(self.rng_state[0])
        self.rng_state[0] = key
        return sub

    def seed(self, seed: int):
        self.rng_state[0] = mx.random.key(seed)

    def fork(self, key) -> "Device":
        """The same settings with a random stream of its own, starting at ``key`` (so a recomputed
        forward pass, e.g. under gradient checkpointing, draws the same dropout masks again)."""
        other = copy.copy(self)
        other.rng_state = [key]
        return other

    def __repr__(self):
        return f"Device(kernels={self.kernels!r}, stream={self.stream})"


_default: Device | None = None


def default_device() -> Device:
    """The process-wide default Device (created on first use)."""
    global _default
    if _default is None:
        _default = Device()
    return _default


def set_default_device(device: Device) -> None:
    global _default
    _default = device


def resolve(device: Device | None) -> Device:
    return default_device() if device is None else device
