"""Launch configurations of the Triton kernels, chosen from tables rather than autotuned.

Autotuning on first call would run benchmarks (and allocate, and synchronise) the first time a shape
is seen, which can be in the middle of CUDA graph capture. The kernels therefore read a fixed table,
keyed on the device's architecture and on ``(Dqk, Dv, causal, dtype)``. ``benchmarks/tune_triton.py``
sweeps candidate configurations on a GPU and prints the best ones; copy them into the tables below.

For experiments, ``MLA_OPS_TRITON_CONFIG="BLOCK_M,BLOCK_N,num_warps,num_stages[,FLAG...]"`` overrides
the attention table for every call. The flags, in any order (see :class:`AttentionConfig`):

- ``tma`` (or ``1``): load K/V through TMA tensor descriptors; ``ptr`` (or ``0``): pointer loads (default);
- ``qo``: also load Q and store the output through TMA descriptors;
- ``ws``: warp-specialise the key loop (needs ``tma``, ``qo`` and, on Hopper, 4 warps; not with ``lazy``).
  Experimental: a GPU launch of it is refused unless ``MLA_OPS_TRITON_EXPERIMENTAL_WS=1`` (see
  :func:`refuse_unproven_warp_specialization`);
- ``lazy``: rescale the accumulator only when a row's max grew by more than 2^8;
- ``ovl``: overlap each key tile's softmax with the previous tile's P @ V product (not with ``ws``
  or ``lazy``);
- ``gluon``: the Hopper kernel written in Gluon (``128,BLOCK_N,4,STAGES,gluon``; of the other flags only
  ``ovl``, ``pp`` and ``pers``);
- ``pp``: with ``gluon,ovl``, the Gluon kernel's two consumer warpgroups take turns issuing their products;
- ``pers``: with ``gluon``, persistent programs: one per multiprocessor, each taking work items until none is left.

e.g. ``128,64,4,2,tma,qo,ws``, ``128,64,8,3,tma,qo,lazy``, ``128,64,8,3,tma,ovl`` or ``128,128,4,2,gluon,ovl,pp``.

This module does not import Triton, so the tables can be read (and tested) without it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

#: Environment variable that overrides the attention launch configuration.
CONFIG_ENV_VAR = "MLA_OPS_TRITON_CONFIG"
#: Environment variable that lets the experimental ``ws`` variant launch on a GPU ("1").
EXPERIMENTAL_WS_ENV_VAR = "MLA_OPS_TRITON_EXPERIMENTAL_WS"

_FORMAT = "BLOCK_M,BLOCK_N,num_warps,num_stages[,tma][,qo][,ws][,lazy][,ovl][,gluon][,pp][,pers]"

#: Named flags of the configuration text and the fields they set (``0``/``ptr`` clear ``use_tma``).
_FLAGS = {
    "tma": "use_tma",
    "1": "use_tma",
    "qo": "qo_tma",
    "ws": "warp_specialize",
    "lazy": "lazy_rescale",
    "ovl": "overlap_softmax",
    "gluon": "gluon",
    "pp": "pingpong",
    "pers": "persistent",
}
_CLEAR_FLAGS = ("0", "ptr")


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
        use_tma: load K and V through TMA tensor descriptors (Hopper and newer, Triton with
            ``triton.tools.tensor_descriptor``). Inputs a descriptor cannot describe fall back to
            plain pointer loads.
        qo_tma: load the Q block and store the output block through TMA descriptors too. Rows past
            a sequence are zeroed after the load; a sequence's last, partial block stores through
            masked pointers (a descriptor store cannot mask rows).
        warp_specialize: run every key tile in one warp-specialised loop
            (``tl.range(warp_specialize=True)``). On Hopper, Triton 3.6 splits it into a TMA producer
            warp group and two consumer warp groups of ``num_warps`` warps, each owning half of the
            query block, so it needs ``use_tma`` and ``qo_tma`` (it fails when a dot operand comes
            from pointer loads) and ``num_warps=4`` (it ignores the request at any other count): 12
            warps run per program. Every tile is masked (one compare per score) and the output is
            stored through pointers; the kernel's docstring of ``_attend_tiles_ws`` says why. K and V
            come through descriptors each program builds over its own sequence's and head's rows, so
            rows outside the sequence read as zeros; Triton's launcher allocates them 128 bytes of global
            scratch each per program and launch.
            Without descriptors (an input TMA cannot describe) the usual loops run instead.
            Experimental: it compiles for sm_90a, but its launches deadlocked on an H200 with Triton
            3.6.0, so a GPU launch is refused by default (:func:`refuse_unproven_warp_specialization`).
        lazy_rescale: in the mask-free key loop, rescale the accumulator only when some row's
            running max grew by more than 2^8 (FlashAttention-4's conditional rescale); exact, it
            only changes how often the rescale runs. Not with ``warp_specialize``: its branch is an
            ``if`` with an else block, and Triton 3.6 then silently declines to specialise.
        overlap_softmax: compute each key tile's softmax while the tensor cores run the previous
            tile's P @ V (FlashAttention-3's intra-warpgroup overlap, one tile deep), over the
            mask-free tiles and the masked ones at the end alike: a step issues the next tile's
            Q @ K^T, then this tile's P @ V, then the next tile's exponentials. The probabilities
            of one tile stay in registers across a step. Not with ``warp_specialize`` (whose loop is
            a different one) or ``lazy_rescale`` (whose branch would sit between the overlapped
            products and serialise them).
        gluon: run the Hopper kernel written in Gluon (:mod:`mla_ops.kernels.attention_sm90`:
            a TMA producer warp and two consumer warpgroups of 64 query rows, FlashAttention-3's
            structure) instead of the ``tl.dot`` kernel. SM90 only; it needs ``block_m=128``,
            ``num_warps=4`` (one consumer warpgroup runs in the program's own warps, the other two
            partitions in warps of their own: 12 per program), ``block_n`` of 64 or 128, and
            ``num_stages`` buffers in each of its K and V rings; it always loads through TMA, so of the
            flags above only ``overlap_softmax`` combines with it (the same overlap, in each consumer
            warpgroup). Inputs it does not cover
            (:func:`mla_ops.kernels.attention_sm90.sm90_unsupported_reason`) are refused when the
            configuration is requested explicitly, and left to the ``tl.dot`` kernel when it comes
            from the table.
        pingpong: with ``gluon`` and ``overlap_softmax``, the two consumer warpgroups take turns issuing
            their products, one tile each, through a pair of mbarriers (FlashAttention-3's ping-pong
            schedule): one warpgroup's softmax then runs while the other's products hold the tensor
            cores, instead of leaving that order to the warp schedulers.
        persistent: with ``gluon``, one program per multiprocessor, each taking work items (blocks of
            128 query rows of one head) from a global counter until none is left, instead of one program
            per item: an item's Q and first key tiles load while the previous item's last products and
            stores finish, which matters where items have few key tiles (short sequences).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False
    qo_tma: bool = False
    warp_specialize: bool = False
    lazy_rescale: bool = False
    overlap_softmax: bool = False
    gluon: bool = False
    pingpong: bool = False
    persistent: bool = False

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
        if self.warp_specialize and not (self.use_tma and self.qo_tma):
            problems.append(
                "warp_specialize needs use_tma and qo_tma (the 'tma' and 'qo' flags): Triton specialises only "
                "loops whose dot operands all come through TMA"
            )
        if self.warp_specialize and self.lazy_rescale:
            problems.append(
                "warp_specialize and lazy_rescale do not combine (the 'ws' and 'lazy' flags): the lazy rescale's "
                "branch makes Triton 3.6 decline warp specialisation"
            )
        if self.overlap_softmax and (self.warp_specialize or self.lazy_rescale):
            problems.append(
                "overlap_softmax combines with neither warp_specialize nor lazy_rescale (the 'ovl' flag with 'ws' "
                "or 'lazy'): each replaces the same key loop"
            )
        if self.gluon and (self.block_m != 128 or self.num_warps != 4 or self.block_n not in (64, 128)):
            problems.append(
                f"gluon (the Hopper Gluon kernel) needs block_m=128, num_warps=4 and block_n 64 or 128, got "
                f"{self.block_m},{self.block_n},{self.num_warps}"
            )
        if self.gluon and (self.use_tma or self.qo_tma or self.warp_specialize or self.lazy_rescale):
            problems.append(
                "gluon combines with none of 'tma', 'qo', 'ws' and 'lazy': its kernel always loads through TMA in a "
                "warp-specialised producer, and has no lazy rescale"
            )
        if self.pingpong and not (self.gluon and self.overlap_softmax):
            problems.append(
                "pingpong (the 'pp' flag) needs gluon and overlap_softmax ('gluon,ovl'): the turns are taken in the "
                "Gluon kernel's overlapped loop"
            )
        if self.persistent and not self.gluon:
            problems.append("persistent (the 'pers' flag) needs gluon: only the Gluon kernel has persistent programs")
        if self.warp_specialize and self.num_warps != 4:
            problems.append(
                f"warp_specialize needs num_warps=4 (two consumer warp groups of 4 warps and a producer), "
                f"got {self.num_warps!r}"
            )
        if problems:
            raise ValueError("invalid Triton attention config: " + "; ".join(problems))

    def __str__(self) -> str:
        flags = "".join(f",{flag}" for flag, name in _FLAGS.items() if flag != "1" and getattr(self, name))
        return f"{self.block_m},{self.block_n},{self.num_warps},{self.num_stages}{flags}"

    @classmethod
    def parse(cls, text: str, source: str = CONFIG_ENV_VAR) -> AttentionConfig:
        """Parse ``"BLOCK_M,BLOCK_N,num_warps,num_stages[,FLAG...]"`` (flags: ``tma``/``1``, ``ptr``/``0``,
        ``qo``, ``ws``, ``lazy``, ``ovl``, ``gluon``, ``pp``, ``pers``); raises ``ValueError`` saying what is wrong."""
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
            if flag in _CLEAR_FLAGS:
                flags["use_tma"] = False
            elif flag in _FLAGS:
                flags[_FLAGS[flag]] = True
            else:
                raise ValueError(
                    f"{source}={text!r}: unknown flag {field!r}; after the four numbers come any of "
                    f"'tma' (or 1), 'ptr' (or 0), 'qo', 'ws', 'lazy', 'ovl', 'gluon', 'pp', 'pers'"
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
# benchmarks/results/h200/tune_ovl.log): causal 128,64,8,3 (453/494/388 TFLOP/s on 4x4096 H16,
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

#: Hopper, batches of at least ``TMA_MIN_KEY_ROWS`` key rows times heads (mla_ops.kernels.attention),
#: where the Gluon kernel's host-built descriptors cost less than they save. (192, 128): 128-key tiles in
#: 2 buffers per ring, each tile's softmax under the previous tile's P @ V ('ovl'), persistent programs
#: that take work items from a counter ('pers'). benchmarks/tune_triton.py on an H200 (2026-12-03 09:20
#: UTC, torch 2.11, triton 3.6, benchmarks/results/h200/tune_gluon_pers.log), TFLOP/s on causal 4x4096
#: H16, 2x8192 H128, the mixed batch, 1k over 8k at H16 / H128: 644 / 652 / 506 / 454 / 726, against
#: 665 / 712 / 601 / 706 / 709 for FlashInfer's fa3 in the same run; a program per work item (the former
#: entry, 'ovl') 573 / 659 / 469 / 516 / 658; persistent with ping-pong turns ('ovl,pp,pers') 604 / 672 /
#: 503 / 477 / 719. Earlier (2026-12-02 20:31 UTC, tune_gluon_ovl.log): the serial loop 559 / 575 / 457 /
#: 326 / 656; 64-key tiles in 3 buffers 526 / 615 / 456 / 595 / 616 ('ovl') and 513 / 569 / 431 / 590 /
#: 577 ('ovl,pp'). The H16 chunk (a 0.13 ms kernel) is timed with part of its launch's host time: 317-666
#: for 'ovl,pers' and 516-687 for 'ovl' in the runs of 2026-12-02/03 (README, Known limitations).
#: Triton releases (major.minor) whose Gluon the Hopper kernel is written for and was checked with on an
#: H200; with any other the kernel is not chosen and an explicit ``gluon`` configuration is refused.
GLUON_TRITON_RELEASES = ("3.6",)


def gluon_triton_reason(version: str) -> str | None:
    """Why the Gluon kernel does not run with Triton ``version``, or ``None`` for the releases it is written
    and checked against (:data:`GLUON_TRITON_RELEASES`): Gluon is experimental and its API changes
    between releases (Triton 3.9 removed the TMA copy the kernel issues)."""
    release = ".".join(version.split(".")[:2])
    if release in GLUON_TRITON_RELEASES:
        return None
    checked = ", ".join(GLUON_TRITON_RELEASES)
    return f"it is written for the Gluon of Triton {checked}, whose API later releases changed (installed: {version})"


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
    ``None``: SM90 only, since the Gluon kernel is built from Hopper's wgmma and TMA instructions."""
    return _lookup(SM90_LARGE_BATCH_ATTENTION, dqk, dv, causal, dtype) if tuple(capability) == (9, 0) else None


def merge_config(device: torch.device) -> MergeConfig:
    """The merge kernel's configuration on ``device``."""
    if device.type == "cuda":
        major = _device_traits(device.index if device.index is not None else torch.cuda.current_device())[0]
        if major == 9:
            return SM90_MERGE
    return GENERIC_MERGE


def experimental_ws_allowed() -> bool:
    """Whether ``MLA_OPS_TRITON_EXPERIMENTAL_WS=1`` lets the ``ws`` variant launch on a GPU (unset or ``0``: no);
    raises ``ValueError`` naming the variable for any other value."""
    text = os.environ.get(EXPERIMENTAL_WS_ENV_VAR, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(
            f"{EXPERIMENTAL_WS_ENV_VAR} must be 1 (allow the 'ws' variant) or 0 (the default), got {text!r}"
        )
    return text == "1"


def refuse_unproven_warp_specialization(config: AttentionConfig, device: torch.device) -> None:
    """Raise ``RuntimeError`` when ``config`` asks for the ``ws`` loop on a CUDA device and
    ``MLA_OPS_TRITON_EXPERIMENTAL_WS=1`` is not set.

    The variant compiles for sm_90a (``benchmarks/compile_sm90.py``: specialised, no spills) and
    passes the interpreter's tests, but on an NVIDIA H200 with Triton 3.6.0 every launch tried
    deadlocked (2026-12-01): single sequences of 1, 128 and 8192 keys, causal and not, each still
    running after 45 s. A call that never returns is worse than an error, so the variant launches
    only on request, for work on that deadlock.
    """
    if config.warp_specialize and device.type == "cuda" and not experimental_ws_allowed():
        raise RuntimeError(
            f"the Triton attention config {config} asks for the experimental 'ws' (warp-specialised) "
            f"loop, whose launches deadlocked on an NVIDIA H200 with Triton 3.6.0; drop the 'ws' flag (e.g. from "
            f"{CONFIG_ENV_VAR}), or set {EXPERIMENTAL_WS_ENV_VAR}=1 to launch it anyway (the call may never return)"
        )
