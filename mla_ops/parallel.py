"""Tensor parallelism for :class:`mla_ops.model.MLAAttention`: the heads split over a process group.

:class:`TensorParallelMLAAttention` holds ``H / P`` of the layer's heads on each of ``P`` ranks (Megatron
layout: column-parallel ``q_proj``/``q_b_proj`` and ``kv_b_proj``, replicated latent projections,
row-parallel ``o_proj`` followed by one all-reduce); :func:`shard_state_dict` cuts an unsplit checkpoint
into a rank's share. Usage: README.md (Tensor parallelism); tests: ``tests/test_tensor_parallel.py`` (gloo)
and ``tests/test_gpu_multi.py`` (NCCL).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .api import prefill_with_context
from .model import AttentionFn, MLAAttention, MLAConfig

__all__ = ["TensorParallelMLAAttention", "heads_per_rank", "shard_state_dict"]

#: The dimension along which each split weight is cut (``nn.Linear`` weights are ``[out, in]``): the
#: output rows of the column-parallel projections, the input columns of the row-parallel ``o_proj``.
#: Every other parameter is replicated.
SPLIT_DIMS: dict[str, int] = {"q_proj": 0, "q_b_proj": 0, "kv_b_proj": 0, "o_proj": 1}

_LAUNCH_HINT = (
    "start one process per GPU with torchrun (torchrun --nproc-per-node N script.py) and call "
    "torch.distributed.init_process_group('nccl') (or 'gloo' for CPU tensors) before building the layer"
)


def heads_per_rank(num_heads: int, world_size: int) -> int:
    """``num_heads / world_size``; raises ``ValueError`` unless ``world_size`` divides ``num_heads``."""
    if world_size < 1 or num_heads % world_size:
        raise ValueError(
            f"cannot split {num_heads} attention heads over {world_size} tensor-parallel ranks: the TP size must "
            f"divide the head count (use one of {', '.join(str(d) for d in _divisors(num_heads))})"
        )
    return num_heads // world_size


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shard_state_dict(
    state_dict: Mapping[str, torch.Tensor], num_heads: int, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s share of an unsplit :class:`MLAAttention` state dict, as views (no copies).

    Keys may carry a prefix (``"layers.3.self_attn.q_b_proj.weight"``): a key is split by the module
    name before its last component, as :data:`SPLIT_DIMS` says, so a whole checkpoint can be passed.

    Args:
        state_dict: the unsplit layer's tensors, e.g. ``layer.state_dict()``.
        num_heads: the unsplit layer's head count ``H``.
        rank: this rank's index in the tensor-parallel group, ``0 <= rank < world_size``.
        world_size: the tensor-parallel size ``P``; it must divide ``H``.

    Returns:
        The same keys; split weights narrowed to this rank's ``H / P`` heads, others as given.

    Raises:
        ValueError: if ``P`` does not divide ``H``, ``rank`` is out of range, or a split weight's size
            along its split dimension is not a multiple of ``H``.
    """
    heads_per_rank(num_heads, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world_size} ranks")
    shards: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        parts = key.split(".")
        dim = SPLIT_DIMS.get(parts[-2]) if len(parts) >= 2 else None
        if dim is None:
            shards[key] = tensor
            continue
        size = tensor.shape[dim]
        if size % num_heads:
            raise ValueError(
                f"{key} has {size} entries along dimension {dim}, which is not a whole number per head for "
                f"{num_heads} heads; pass the unsplit layer's state dict and its head count"
            )
        block = size // world_size
        shards[key] = tensor.narrow(dim, rank * block, block)
    return shards


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"TensorParallelMLAAttention needs torch.distributed to be initialised: {_LAUNCH_HINT}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group; pass a group that contains it")
    return rank, dist.get_world_size(group)


class TensorParallelMLAAttention(MLAAttention):
    """:class:`MLAAttention` with its heads split over a ``torch.distributed`` process group.

    It is an :class:`MLAAttention` of ``H / P`` heads (``self.config``; the unsplit configuration is
    ``self.full_config``) whose forward ends with an all-reduce over ``group``: its methods
    (``queries``, ``compress``, ``expand``) and the attention ops run unchanged on the local heads.
    Usable eagerly, under ``torch.compile(fullgraph=True)`` (the all-reduce is traced as a functional
    collective) and in captured CUDA graphs (NCCL all-reduces can be captured; make one eager call
    first, which also creates the NCCL communicator).

    Args:
        config: the **unsplit** layer's configuration.
        group: the tensor-parallel process group; ``None`` is the default group.
        device, dtype: where and how to allocate the parameters.
        attention: as for :class:`MLAAttention`.

    Weights are initialised at random per rank; build from an unsplit layer with :meth:`from_dense`, or
    load a rank's share of a checkpoint with ``load_state_dict(shard_state_dict(...))``.

    Raises:
        RuntimeError: if ``torch.distributed`` is not initialised.
        ValueError: if the group size does not divide ``config.num_heads``.
    """

    def __init__(
        self,
        config: MLAConfig,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        attention: AttentionFn = prefill_with_context,
    ) -> None:
        rank, world_size = _rank_and_size(group)
        local = dataclasses.replace(config, num_heads=heads_per_rank(config.num_heads, world_size))
        super().__init__(local, device=device, dtype=dtype, attention=attention)
        self.full_config = config
        self.group = group
        self.tp_rank = rank
        self.tp_size = world_size

    @classmethod
    def from_dense(
        cls,
        layer: MLAAttention,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> TensorParallelMLAAttention:
        """This rank's share of ``layer`` (copied; ``layer`` is left as it is).

        Every rank must pass a layer with the same weights (e.g. loaded from one checkpoint, or made
        with the same seed and broadcast from one rank). The replicated parameters are copied whole,
        the split ones as :func:`shard_state_dict` cuts them.

        Args:
            layer: the unsplit layer.
            group: the tensor-parallel process group; ``None`` is the default group.
            device: where the share lives; by default ``layer``'s device.
        """
        weight = layer.o_proj.weight
        device = weight.device if device is None else torch.device(device)
        # Built on the meta device, so nothing is initialised only to be overwritten.
        tp = cls(layer.config, group, device="meta", dtype=weight.dtype, attention=layer.attention)
        tp.to_empty(device=device)
        with torch.no_grad():
            tp.load_state_dict(shard_state_dict(layer.state_dict(), layer.config.num_heads, tp.tp_rank, tp.tp_size))
        return tp

    #: This rank's term of the output, ``[T, hidden_size]``: the unsplit layer's computation on this
    #: rank's heads, through its ``o_proj`` columns. The sum of every rank's term is the unsplit layer's
    #: output; :meth:`forward` adds the all-reduce. Arguments as for :meth:`MLAAttention.forward`.
    partial_forward = MLAAttention.forward

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum ``partial`` over the group, in place; returns it."""
        if self.tp_size > 1:
            dist.all_reduce(partial, group=self.group)
        return partial

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Attention output ``[T, hidden_size]``, the same on every rank of the group: :meth:`partial_forward`,
        then :meth:`all_reduce`.

        Takes the arguments of :meth:`MLAAttention.forward` (``hidden``, ``positions``, ``cu_seqlens``,
        ``max_seqlen``, ``context``), each the same on every rank (replicated activations).
        """
        return self.all_reduce(self.partial_forward(*args, **kwargs))

    def extra_repr(self) -> str:
        heads = f"{self.config.num_heads} of {self.full_config.num_heads}"
        return f"tp_rank={self.tp_rank}, tp_size={self.tp_size}, heads={heads}"
