"""Launch configurations of the Triton kernels, chosen from tables rather than autotuned.

The tables (keyed on the device's architecture and ``(Dqk, Dv, causal, dtype)``), :class:`AttentionConfig`,
the ``MLA_OPS_TRITON_CONFIG`` override and its flags (``ovl``; ``gluon,ovl,pers``: the variants the tables use;
the flags of removed variants are refused with the reason, :data:`REMOVED_FLAGS`), and the rules that refuse
what cannot run. It does not import Triton, so the tables can be read (and tested) without it.
Design: docs/design/launch-configs.md.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

#: Environment variable that overrides the attention launch configuration.
CONFIG_ENV_VAR = "MLA_OPS_TRITON_CONFIG"
_FORMAT = "BLOCK_M,BLOCK_N,num_warps,num_stages[,ovl][,gluon,ovl,pers[,pp]]"

#: Named flags of the configuration text and the fields they set.
_FLAGS = {"ovl": "overlap_softmax", "gluon": "gluon", "pers": "persistent", "pp": "pingpong"}

#: Flags of variants that were tuned on an H200 (torch 2.11, Triton 3.6, 2026-12-01 to 12-03) and that no
#: table chose, so they left the kernels; each with what made it unneeded.
REMOVED_FLAGS = {
    "tma": "TMA descriptor loads of K and V in the tl.dot kernel; no table chose them (the pointer loads with "
    "'ovl' were as fast, and on Hopper large batches run the Gluon kernel, which loads through TMA)",
    "1": "the old spelling of 'tma', whose variant was removed",
    "0": "the old spelling of pointer loads, which are now the only loads of the tl.dot kernel",
    "ptr": "pointer loads are now the only loads of the tl.dot kernel",
    "qo": "TMA loads of Q and stores of the output in the tl.dot kernel; no table chose them",
    "ws": "Triton's automatic warp specialisation of the tl.dot key loop; its launches deadlocked on an H200 "
    "with Triton 3.6.0, and the Gluon kernel states its partitions itself",
    "lazy": "the lazy rescale of the tl.dot kernel (FlashAttention-4's); it did not beat the table",
}


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class AttentionConfig:
    """How the attention kernel is launched.

    Attributes:
        block_m: query rows per program (a power of two, 16 to 256).
        block_n: keys per inner-loop step (a power of two, 16 to 256).
        num_warps: warps per program (1, 2, 4, 8 or 16). On Hopper, 8 warps = two warpgroups,
            each owning 64 query rows of a 128-row block.
        num_stages: software-pipelining depth of the K/V loads (1 to 8).
        overlap_softmax: compute each key tile's softmax while the tensor cores run the previous
            tile's P @ V (FlashAttention-3's intra-warpgroup overlap, one tile deep), over the
            mask-free tiles and the masked ones at the end alike: a step issues the next tile's
            Q @ K^T, then this tile's P @ V, then the next tile's exponentials. The probabilities
            of one tile stay in registers across a step. With ``gluon`` it is the Gluon kernel's
            loop, which always overlaps.
        gluon: run the Hopper kernel written in Gluon (:mod:`mla_ops.kernels.attention_sm90`:
            a TMA producer warp and two consumer warpgroups of 64 query rows, FlashAttention-3's
            structure) instead of the ``tl.dot`` kernel. SM90 only; it needs ``block_m=128``,
            ``num_warps=4`` (one consumer warpgroup runs in the program's own warps, the other two
            partitions in warps of their own: 12 per program), ``block_n`` of 64 or 128, ``num_stages``
            buffers in each of its K and V rings, and ``overlap_softmax`` and ``persistent``, the
            form the large-batch table runs. Inputs it does not cover
            (:func:`mla_ops.kernels.attention_sm90.sm90_unsupported_reason`) are refused when the
            configuration is requested explicitly, and left to the ``tl.dot`` kernel when it comes
            from the table.
        persistent: with ``gluon``: one program per multiprocessor, each taking work items (blocks of
            128 query rows of one head) from a global counter until none is left: an item's Q and first
            key tiles load while the previous item's last products and stores finish, which matters
            where items have few key tiles (short sequences).
        pingpong: with ``gluon``: the two consumer warpgroups take turns issuing their products
            (FlashAttention-3's ping-pong), so that one's softmax runs under the other's products
            instead of both exponentiating at once.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    overlap_softmax: bool = False
    gluon: bool = False
    persistent: bool = False
    pingpong: bool = False

    def __post_init__(self) -> None:
        problems = []
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or not _is_power_of_two(value) or not 16 <= value <= 256:
                problems.append(f"{name} must be a power of two from 16 to 256, got {value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            problems.append(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            problems.append(f"num_stages must be an integer from 1 to 8, got {self.num_stages!r}")
        if self.gluon and (self.block_m != 128 or self.num_warps != 4 or self.block_n not in (64, 128)):
            problems.append(
                f"gluon (the Hopper Gluon kernel) needs block_m=128, num_warps=4 and block_n 64 or 128, got "
                f"{self.block_m},{self.block_n},{self.num_warps}"
            )
        if self.gluon and not (self.overlap_softmax and self.persistent):
            problems.append(
                "gluon needs 'ovl' and 'pers' too ('gluon,ovl,pers'): the Gluon kernel always overlaps its softmax "
                "and runs persistent programs, the form the large-batch table uses"
            )
        if self.persistent and not self.gluon:
            problems.append("persistent (the 'pers' flag) needs gluon: only the Gluon kernel has persistent programs")
        if self.pingpong and not self.gluon:
            problems.append("pingpong (the 'pp' flag) needs gluon: only the Gluon kernel has two consumer warpgroups")
        if problems:
            raise ValueError("invalid Triton attention config: " + "; ".join(problems))

    def __str__(self) -> str:
        flags = "".join(f",{flag}" for flag, name in _FLAGS.items() if getattr(self, name))
        return f"{self.block_m},{self.block_n},{self.num_warps},{self.num_stages}{flags}"

    @classmethod
    def parse(cls, text: str, source: str = CONFIG_ENV_VAR) -> AttentionConfig:
        """Parse ``"BLOCK_M,BLOCK_N,num_warps,num_stages[,FLAG...]"`` (flags: ``ovl``, ``gluon``, ``pers``, ``pp``);
        raises ``ValueError`` saying what is wrong."""
        fields = [f.strip() for f in text.split(",")]
        if len(fields) < 4:
            raise ValueError(f"{source} must be {_FORMAT!r} (e.g. '128,64,8,3'), got {text!r}")
        try:
            numbers = [int(f) for f in fields[:4]]
        except ValueError:
            raise ValueError(
                f"{source} must be {_FORMAT!r} with integer fields (e.g. '128,64,8,3'), got {text!r}"
            ) from None
        flags: dict[str, bool] = {}
        for field in fields[4:]:
            flag = field.lower()
            if flag in _FLAGS:
                flags[_FLAGS[flag]] = True
            elif flag in REMOVED_FLAGS:
                raise ValueError(
                    f"{source}={text!r}: the flag {field!r} was removed ({REMOVED_FLAGS[flag]}); drop it, the "
                    f"flags are 'ovl' and 'gluon,ovl,pers[,pp]'"
                )
            else:
                raise ValueError(
                    f"{source}={text!r}: unknown flag {field!r}; after the four numbers come 'ovl' or "
                    f"'gluon,ovl,pers[,pp]'"
                )
        try:
            return cls(*numbers, **flags)
        except ValueError as exc:
            raise ValueError(f"{source}={text!r}: {exc}") from None


@dataclass(frozen=True)
class MergeConfig:
    """Launch configuration of the merge kernel: ``block_t`` tokens of one head per program."""

    block_t: int
    num_warps: int


# --- tables ---------------------------------------------------------------------------------------
#
# Keys: (Dqk, Dv, causal) -> config, or (Dqk, Dv, causal, dtype) for a dtype-specific entry, which
# wins over the dtype-free one. Edit these with the output of benchmarks/tune_triton.py.

#: Hopper (SM90, H100/H200: 227 KiB shared memory per block). 8 warps = two warpgroups on a
#: 128-row query block. For (192, 128) one K/V stage of 64 keys is 40 KiB next to a 48 KiB Q tile.
# (192, 128) from benchmarks/tune_triton.py on an H200 (2026-12-02, torch 2.11, triton 3.6,
# benchmarks/results/h200/tune_ovl.log at commit 8fe6e83): causal 128,64,8,3 (453/494/388 TFLOP/s on 4x4096 H16,
# 2x8192 H128, mixed H128; its 'ovl' twin 440/482/369, the TMA ones 415-427/458-483/340-350); chunk
# 128,64,8,3,ovl (495/496 TFLOP/s on 1k over 8k at H16/H128, against 467/494 for the former entry
# 128,64,8,4,tma and 414/429 for 128,64,8,3, whose wgmma ptxas serialises on this path).
SM90_ATTENTION: dict[tuple, AttentionConfig] = {
    (192, 128, True): AttentionConfig(128, 64, 8, 3),
    (192, 128, False): AttentionConfig(128, 64, 8, 3, overlap_softmax=True),
    (128, 128, True): AttentionConfig(128, 64, 8, 3),
    (128, 128, False): AttentionConfig(128, 128, 8, 2),
    (64, 64, True): AttentionConfig(128, 64, 4, 3),
    (64, 64, False): AttentionConfig(128, 64, 4, 3),
}

#: Ampere/Ada (SM80/SM86/SM89) and anything untuned: sized for 99-163 KiB of shared memory, and
#: shrunk further by :func:`fit_shared_memory` where the device has less.
GENERIC_ATTENTION: dict[tuple, AttentionConfig] = {
    (192, 128, True): AttentionConfig(128, 64, 8, 2),
    (192, 128, False): AttentionConfig(128, 64, 8, 2),
    (64, 64, True): AttentionConfig(128, 64, 4, 2),
    (64, 64, False): AttentionConfig(128, 64, 4, 2),
}

_ARCH_TABLES: dict[int, dict[tuple, AttentionConfig]] = {9: SM90_ATTENTION}

#: The Gluon kernel's fp8 variant (mla_ops.kernels.attention_sm90 with ``scales``), the large-batch table of fp8 calls
#: (:func:`table_large_batch_config`): compiled for sm_90a by benchmarks/compile_sm90.py --dtype float8_e4m3fn;
#: tests/test_gpu_gluon_fp8.py checks it on a Hopper GPU (passed on an H100, docs/design/fp8.md). 128-key tiles (an
#: e4m3 tile is half a bf16 one's bytes and tensor-core time, so rings of 3-4 buffers look as far ahead in time as the
#: bf16 entry's 2 below) and the consumers taking turns ('pp'): fp8 halves the products' time, not the softmax's.
#: benchmarks/tune_triton.py --dtype float8_e4m3fn on an H100 (2026-12-06, torch 2.11, Triton 3.6), TFLOP/s on causal
#: 4x4096 H16 / 2x8192 H128 / 1x16384 H128 / the mixed batch H128, and 1k over 128k H128: 4 buffers 742 / 913 / 965 /
#: 570 and 905; with 'pp' 737 / 904 / 999 / 576 and 902 (the best causal geometric mean, 786.7 against 781.5); 3
#: buffers 735 / 907 / 1007 / 566 and 883; with 'pp' 735 / 876 / 1015 / 574 and 920 (the best chunk); 64-key tiles
#: in 6 buffers 670 / 760 / 824 / 546 and 766, with 'pp' 633-774 and 702.
SM90_GLUON_FP8_ATTENTION: dict[tuple, AttentionConfig] = {
    (192, 128, True): AttentionConfig(128, 128, 4, 4, overlap_softmax=True, gluon=True, persistent=True, pingpong=True),
    (192, 128, False): AttentionConfig(
        128, 128, 4, 3, overlap_softmax=True, gluon=True, persistent=True, pingpong=True
    ),
}

#: Hopper, batches of at least ``TMA_MIN_KEY_ROWS`` key rows times heads (mla_ops.kernels.attention),
#: where the Gluon kernel's host-built descriptors cost less than they save. (192, 128): 128-key tiles in
#: 2 buffers per ring, each tile's softmax under the previous tile's P @ V ('ovl'), persistent programs
#: that take work items from a counter ('pers'). benchmarks/tune_triton.py on an H200 (2026-12-03 09:20
#: UTC, torch 2.11, triton 3.6, benchmarks/results/h200/tune_gluon_pers.log at commit 8fe6e83), TFLOP/s on causal 4x4096
#: H16, 2x8192 H128, the mixed batch, 1k over 8k at H16 / H128: 644 / 652 / 506 / 454 / 726, against
#: 665 / 712 / 601 / 706 / 709 for FlashInfer's fa3 in the same run; a program per work item (the former
#: entry, 'ovl') 573 / 659 / 469 / 516 / 658; persistent with ping-pong turns ('ovl,pp,pers') 604 / 672 /
#: 503 / 477 / 719. Earlier (2026-12-02 20:31 UTC, tune_gluon_ovl.log): the serial loop 559 / 575 / 457 /
#: 326 / 656; 64-key tiles in 3 buffers 526 / 615 / 456 / 595 / 616 ('ovl') and 513 / 569 / 431 / 590 /
#: 577 ('ovl,pp'). The H16 chunk (a 0.13 ms kernel) is timed with part of its launch's host time: 317-666
#: for 'ovl,pers' and 516-687 for 'ovl' in the runs of 2026-12-02/03 (README, Known limitations).
SM90_LARGE_BATCH_ATTENTION: dict[tuple, AttentionConfig] = {
    (192, 128, True): AttentionConfig(128, 128, 4, 2, overlap_softmax=True, gluon=True, persistent=True),
    (192, 128, False): AttentionConfig(128, 128, 4, 2, overlap_softmax=True, gluon=True, persistent=True),
}

#: Used for dimensions no table lists, scaled down by head size in :func:`default_attention_config`.
_DEFAULT_LARGE_HEADS = AttentionConfig(128, 64, 8, 2)
_DEFAULT_SMALL_HEADS = AttentionConfig(128, 64, 4, 2)

#: Small blocks for Triton's CPU interpreter (tests), where program count, not tile size, is cheap.
INTERPRETER_ATTENTION = AttentionConfig(16, 16, 4, 1)

# Every candidate with >= 16 tokens per program ran at 4.2 TB/s on an H200 (T=16384, H=128, Dv=128).
SM90_MERGE = MergeConfig(block_t=32, num_warps=4)
GENERIC_MERGE = MergeConfig(block_t=32, num_warps=4)


def head_dim_split(dqk: int) -> tuple[int, int]:
    """How the QK product of a ``dqk``-channel head is split: ``(first, second)`` dot widths.

    ``first`` is the largest power of two <= ``dqk``; ``second`` is the remainder rounded up to a power
    of two (its padding is masked), or 0. DeepSeek's 192 gives ``(128, 64)``: no wasted work.
    """
    first = 1 << (dqk.bit_length() - 1)
    rest = dqk - first
    return first, (1 << (rest - 1).bit_length()) if rest else 0


def shared_memory_estimate(config: AttentionConfig, dqk: int, dv: int, elem_bytes: int = 2) -> int:
    """Bytes of shared memory the attention kernel needs, roughly: the Q tile plus the K/V stages."""
    dqk_p, dv_p = sum(head_dim_split(dqk)), 1 << (dv - 1).bit_length()
    return elem_bytes * (config.block_m * dqk_p + config.num_stages * config.block_n * (dqk_p + dv_p))


def fit_shared_memory(config: AttentionConfig, dqk: int, dv: int, limit: int) -> AttentionConfig:
    """Shrink ``config`` (stages, then BLOCK_N, then BLOCK_M) until its estimate fits ``limit`` bytes."""
    while shared_memory_estimate(config, dqk, dv) > limit:
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        elif config.block_n > 32:
            config = replace(config, block_n=config.block_n // 2)
        elif config.block_m > 64:
            config = replace(config, block_m=config.block_m // 2, num_warps=min(config.num_warps, 4))
        elif config.num_stages > 1:
            config = replace(config, num_stages=1)
        else:
            break
    return config


def shrink(config: AttentionConfig) -> AttentionConfig | None:
    """The next smaller configuration to try after the compiler ran out of resources, or ``None``."""
    if config.num_stages > 1:
        return replace(config, num_stages=config.num_stages - 1)
    if config.block_n > 16:
        return replace(config, block_n=config.block_n // 2)
    if config.block_m > 16:
        return replace(config, block_m=config.block_m // 2, num_warps=min(config.num_warps, 4))
    return None


def _lookup(table: dict[tuple, AttentionConfig], dqk: int, dv: int, causal: bool, dtype: torch.dtype):
    return table.get((dqk, dv, causal, dtype)) or table.get((dqk, dv, causal))


def default_attention_config(dqk: int, dv: int) -> AttentionConfig:
    """A configuration for dimensions no table lists: 8 warps for wide heads, 4 for narrow ones."""
    return _DEFAULT_LARGE_HEADS if dqk + dv > 192 else _DEFAULT_SMALL_HEADS


@functools.cache
def _device_traits(device_index: int) -> tuple[int, int, int]:
    """``(major, minor, shared memory per block in bytes)`` of a CUDA device."""
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    return props.major, props.minor, smem


def table_attention_config(
    capability: tuple[int, int], dqk: int, dv: int, causal: bool, dtype: torch.dtype, shared_memory: int | None = None
) -> AttentionConfig:
    """The table's configuration for a device of ``capability`` (no environment override).

    ``shared_memory`` (bytes per block) shrinks untuned configurations that would not fit.
    """
    table = _ARCH_TABLES.get(capability[0])
    config = _lookup(table, dqk, dv, causal, dtype) if table is not None else None
    if config is None:
        config = _lookup(GENERIC_ATTENTION, dqk, dv, causal, dtype) or default_attention_config(dqk, dv)
    if shared_memory is not None:
        config = fit_shared_memory(config, dqk, dv, shared_memory)
    return config


@functools.cache
def _parse_env(text: str) -> AttentionConfig:
    return AttentionConfig.parse(text)


# os.environ.get costs about a microsecond when the variable is unset (Mapping.get catches the KeyError
# that os.environ's __getitem__ raises), on a path that runs on every eager call; os.environ keeps its
# encoded keys and values in a dict of its own, which one lookup reads.
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_CONFIG_ENV_KEY = os.environ.encodekey(CONFIG_ENV_VAR) if hasattr(os.environ, "encodekey") else None


def config_env_value() -> object:
    """``MLA_OPS_TRITON_CONFIG`` as ``os.environ`` holds it, ``None`` when unset: a value that changes exactly
    when the variable's text does (bytes or text, whichever ``os.environ`` stores), cheap enough for
    every call (the attention kernel's launch layout names it). :func:`env_attention_config` parses it."""
    if isinstance(_ENVIRON_DATA, dict) and _CONFIG_ENV_KEY is not None:
        return _ENVIRON_DATA.get(_CONFIG_ENV_KEY)
    return os.environ.get(CONFIG_ENV_VAR)


def env_attention_config() -> AttentionConfig | None:
    """The configuration forced by ``MLA_OPS_TRITON_CONFIG``, or ``None``; raises ``ValueError`` if malformed."""
    text = os.environ.get(CONFIG_ENV_VAR, "").strip()
    return _parse_env(text) if text else None


def attention_config(device: torch.device, dqk: int, dv: int, causal: bool, dtype: torch.dtype) -> AttentionConfig:
    """The configuration to launch the attention kernel with on ``device``.

    ``MLA_OPS_TRITON_CONFIG`` wins; then the table of the device's architecture; CPU tensors (Triton's
    interpreter) get small blocks.
    """
    forced = env_attention_config()
    if forced is not None:
        return forced
    if device.type != "cuda":
        return INTERPRETER_ATTENTION
    major, minor, smem = _device_traits(device.index if device.index is not None else torch.cuda.current_device())
    return table_attention_config((major, minor), dqk, dv, causal, dtype, smem)


def large_batch_attention_config(
    device: torch.device, dqk: int, dv: int, causal: bool, dtype: torch.dtype
) -> AttentionConfig | None:
    """The configuration for batches of at least ``TMA_MIN_KEY_ROWS`` key rows times heads on ``device``,
    where one is tabled (Hopper: :data:`SM90_LARGE_BATCH_ATTENTION`), else ``None`` (the table of
    :func:`attention_config` serves every batch). ``MLA_OPS_TRITON_CONFIG`` overrides it, as it does
    the table."""
    if device.type != "cuda" or env_attention_config() is not None:
        return None
    major, minor, _ = _device_traits(device.index if device.index is not None else torch.cuda.current_device())
    return table_large_batch_config((major, minor), dqk, dv, causal, dtype)


def table_large_batch_config(
    capability: tuple[int, int], dqk: int, dv: int, causal: bool, dtype: torch.dtype
) -> AttentionConfig | None:
    """The large-batch table's configuration for a device of ``capability`` (no environment override), or
    ``None``: SM90 only, since the Gluon kernel is built from Hopper's wgmma and TMA instructions. fp8 calls
    take :data:`SM90_GLUON_FP8_ATTENTION`, the others :data:`SM90_LARGE_BATCH_ATTENTION`."""
    if tuple(capability) != (9, 0):
        return None
    table = SM90_GLUON_FP8_ATTENTION if dtype == torch.float8_e4m3fn else SM90_LARGE_BATCH_ATTENTION
    return _lookup(table, dqk, dv, causal, dtype)


def merge_config(device: torch.device) -> MergeConfig:
    """The merge kernel's configuration on ``device``."""
    if device.type == "cuda":
        major = _device_traits(device.index if device.index is not None else torch.cuda.current_device())[0]
        if major == 9:
            return SM90_MERGE
    return GENERIC_MERGE
