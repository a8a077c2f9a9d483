"""Hashable descriptions of a device and of an MLA attention configuration.

These types are the inputs of the backend selector. They are plain value types so that selection can
be cached on them and so that tests can simulate any GPU on a machine that has none.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: The dtypes that every op accepts. Anything else is rejected with a ``TypeError``.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)

#: The dtype of the fp8 ops' ``q``, ``k`` and ``v``: e4m3 without infinities (``torch.float8_e4m3fn``), whose
#: largest finite value is :data:`FP8_MAX`. Their outputs are in one of :data:`SUPPORTED_DTYPES`.
FP8_DTYPE: torch.dtype = torch.float8_e4m3fn
FP8_MAX = 448.0


class DeviceCapability(NamedTuple):
    """A CUDA compute capability, e.g. ``DeviceCapability(9, 0)`` for Hopper."""

    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    @classmethod
    def parse(cls, text: str) -> DeviceCapability:
        """Parse ``"9.0"`` (or ``"90"``) into a capability; raises ``ValueError`` on bad text."""
        text = text.strip()
        try:
            if "." in text:
                major, minor = text.split(".", 1)
                return cls(int(major), int(minor))
            if text.isdigit() and len(text) >= 2:
                return cls(int(text[:-1]), int(text[-1]))
        except ValueError:
            pass
        raise ValueError(f"cannot parse compute capability {text!r}; write it as MAJOR.MINOR, e.g. 9.0")

    @classmethod
    def of(cls, device: torch.device) -> DeviceCapability | None:
        """The capability of ``device``, or ``None`` for a CPU (which has none)."""
        if device.type != "cuda":
            return None
        return cls(*torch.cuda.get_device_capability(device))


class MLADimensions(NamedTuple):
    """The head dimensions of an MLA layer.

    ``q``/``k`` heads have ``qk_nope_head_dim + qk_rope_head_dim`` channels and ``v`` heads have
    ``v_head_dim``. DeepSeek-V2/V3/R1 use ``(128, 64, 128)``.
    """

    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        """The channel count of a ``q`` or ``k`` head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_head_dims(cls, qk_head_dim: int, v_head_dim: int) -> MLADimensions:
        """Rebuild dimensions from tensor shapes, which only show ``qk_head_dim`` and ``v_head_dim``.

        The split of ``qk_head_dim`` into its no-position and rotary parts is invisible in a tensor.
        Every backend validates only the two totals, so the split chosen here (DeepSeek's 64 rotary
        channels when there is room for them) never changes a decision; it only makes the printed
        config read like the model's.
        """
        rope = DEEPSEEK_V3.qk_rope_head_dim if qk_head_dim > DEEPSEEK_V3.qk_rope_head_dim else 0
        return cls(qk_head_dim - rope, rope, v_head_dim)


#: The dimensions of DeepSeek-V2, V3 and R1 (and of the many models that copy them).
DEEPSEEK_V3 = MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


class SelectorConfig(NamedTuple):
    """What backend selection depends on, besides the device: the dtype and the MLA dimensions.

    Selection reads only what a tensor shows, ``(dtype, Dqk, Dv)``: two configurations that split the
    same ``Dqk`` differently select the same backend.
    """

    dtype: torch.dtype
    mla_dimensions: MLADimensions = DEEPSEEK_V3

    @property
    def head_dim_qk(self) -> int:
        """``Dqk``, the channel count of a ``q``/``k`` head: what a tensor shows of the QK split."""
        return self.mla_dimensions.qk_head_dim

    @property
    def head_dim_v(self) -> int:
        """``Dv``, the channel count of a ``v`` head."""
        return self.mla_dimensions.v_head_dim

    def __repr__(self) -> str:
        return f"SelectorConfig(dtype={self.dtype}, mla_dimensions={self.mla_dimensions})"
