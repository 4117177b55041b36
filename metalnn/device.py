"""`Device`: where metalnn runs and which kernel implementation its custom ops use."""

from __future__ import annotations

import copy
import os

import mlx.core as mx

KERNEL_CHOICES = ("auto", "reference", "metal", "emulate")


def metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:  # pragma: no cover - very old MLX
        return False


def resolve_kernels(kernels: str) -> str:
    """The kernel choice of a `Device`: ``kernels``, or for ``"auto"`` the ``METALNN_KERNELS``
    environment variable when it is set. ``"metal"`` needs Metal."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"Device: kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if kernels == "auto":
        env = os.environ.get("METALNN_KERNELS", "").strip().lower()
        if env and env not in KERNEL_CHOICES:
            raise ValueError(f"Device: the environment variable METALNN_KERNELS must be one of {KERNEL_CHOICES}, "
                             f"got {env!r}")
        kernels = env or kernels
    if kernels == "metal" and not metal_available():
        raise RuntimeError("Device: kernels='metal' needs Metal (macOS on Apple Silicon); "
                           "use 'auto', 'reference' or 'emulate' here")
    return kernels


class Device:
    """Run settings shared by every layer compiled on it: the implementation of metalnn's custom
    ops and the random key (dropout, sampling). Training mode is the model's (``model.train()`` /
    ``model.eval()``, as in mlx.nn), not the device's.

    Args:
        kernels: the implementation of metalnn's ops (`metalnn.functional`): ``"auto"`` (MLX's
            own fused ops such as ``mx.fast.rms_norm``, ``mx.fast.rope``,
            ``mx.fast.scaled_dot_product_attention`` and ``mx.conv_general``, plain MLX ops where
            MLX has none, and on the CPU backend metalnn's CPU paths where measured faster),
            ``"reference"`` (every op spelled out in plain MLX ops), ``"metal"`` (metalnn's custom
            Metal kernels via ``mx.fast.metal_kernel``; opt-in, needs Metal) or ``"emulate"`` (the
            same Metal source run by the CPU emulator; slow, for testing). The environment
            variable ``METALNN_KERNELS`` only replaces ``"auto"``; an explicit choice wins.
        seed: seed of the device's random key (dropout, sampling).
        stream: an MLX device or stream to run on (default: MLX's default device).
        emulator_options: extra keywords for the emulator on the ``emulate`` path, e.g.
            ``{"lane_order": "shuffled", "seed": 1}`` to shake out races.
    """

    def __init__(self, kernels: str = "auto", seed: int = 0, stream=None, emulator_options: dict | None = None):
        self.kernels = resolve_kernels(kernels)
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
