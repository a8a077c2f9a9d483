"""Input validation shared by the fake kernels, the real kernels and the Python API.

Everything except :func:`check_cu_seqlens_values` looks only at metadata (shape, dtype, device,
strides), so it costs no device sync and works on fake tensors under ``torch.compile``, where it
turns bad input into an error at trace time. :func:`check_cu_seqlens_values` reads the offsets and is
only called where they are already on the host. Design: docs/design/ops.md (Validation).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from ..specs import FP8_DTYPE
from ..specs import SUPPORTED_DTYPES as _DTYPES

#: The largest ``max_seqlen`` the kernels can index (they count tokens in int32).
MAX_SEQLEN_LIMIT = 2**31 - 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_rank3(op: str, name: str, t: object, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{op}: {name} must be a 3-D tensor {layout}, got shape {tuple(t.shape)}")
    return t


def _check_unit_stride(op: str, names: Sequence[str], tensors: Sequence[torch.Tensor], fp8: bool = False) -> None:
    for name, t in zip(names, tensors):
        if t.numel() > 0 and t.stride(-1) != 1:
            also = ""
            if fp8 and name == "v":  # the fp8 ops also take v key-major: unit stride over the keys
                also = " (or, for v of the fp8 ops, in its first: quantize_fp8(v, key_major=True))"
            raise ValueError(
                f"{op}: {name} must have stride 1 in its last dimension{also} (got strides {tuple(t.stride())}); "
                f"pass {name}.contiguous() or a view that keeps the head channels contiguous"
            )


def _check_cu_seqlens(op: str, name: str, cu: object, device: torch.device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{op}: {name} must be an int32 torch.Tensor [B+1], got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{op}: {name} must have dtype int32, got {_dtype_name(cu.dtype)}; use {name}.to(torch.int32)")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{op}: {name} must be a 1-D tensor [B+1] starting at 0, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{op}: {name} is on {cu.device} but q is on {device}; move it to {device}")
    return cu


def check_max_seqlen(op: str, name: str, value: object) -> None:
    """``value`` must be an int (or ``SymInt``) in ``[0, MAX_SEQLEN_LIMIT]``: a ``TypeError`` or ``ValueError``
    naming ``name`` otherwise."""
    if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r:.40}")
    if value < 0:
        raise ValueError(f"{op}: {name} must be >= 0, got {value}")
    if value > MAX_SEQLEN_LIMIT:
        raise ValueError(
            f"{op}: {name} must be at most 2**31 - 1 = {MAX_SEQLEN_LIMIT} (the kernels count tokens in int32), "
            f"got {value}; pass an upper bound of the longest sequence"
        )


def _check_grad(op: str, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in zip(names, tensors):
        if t.requires_grad:
            raise RuntimeError(
                f"{op} is inference-only (it has no backward), but {name} requires grad and grad mode is on. "
                f"Call it under torch.no_grad() or torch.inference_mode(), or pass {name}.detach()"
            )


def _check_scale(op: str, softmax_scale: object) -> None:
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"{op}: softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"{op}: softmax_scale must be finite, got {softmax_scale}")


_BF16, _FP16, _FP32, _INT32, _FP8 = torch.bfloat16, torch.float16, torch.float32, torch.int32, FP8_DTYPE


#: What :func:`checked_attention_sizes` returns of accepted inputs: ``(device, dtype, q_shape, rows_k, head_dim_v,
#: len_cu_seqlens_q)``, that is ``q``'s device and dtype, its shape ``(T, H, Dqk)``, ``k``'s rows, ``v``'s last
#: dimension and ``cu_seqlens_q``'s length (sequences + 1): every size the ops route a call by.
AttentionSizes = tuple[torch.device, torch.dtype, torch.Size, int, int, int]


def checked_attention_sizes(
    q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, self_attention, fp8: bool = False
) -> AttentionSizes | None:
    """The sizes of these inputs (:data:`AttentionSizes`) where :func:`check_attention_inputs` would accept them,
    else ``None``, in one expression: this runs on every eager call, so it avoids helper calls and message
    formatting (the ops' kernels call it first and :func:`check_attention_inputs` only when it says no, for the
    error that explains the problem). It returns the sizes it read for the check, so that the ops' routing
    (:func:`mla_ops.selector.route_checked`) reads none of them again. An argument that is not a tensor (``None``
    for a raw op's ``Tensor``) makes it say no as well. ``fp8``: the rules of the fp8 ops, whose ``q``/``k``/``v``
    are :data:`~mla_ops.specs.FP8_DTYPE`."""
    # The try is free until it catches (Python 3.11+): only a call with a non-tensor pays for it.
    try:
        qs, ks, vs, dt, dev = q.shape, k.shape, v.shape, q.dtype, q.device
        valid = (
            len(qs) == 3
            and len(ks) == 3
            and len(vs) == 3
            and (dt is _FP8 if fp8 else (dt is _BF16 or dt is _FP16))
            and qs[1] > 0
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and k.dtype is dt
            and v.dtype is dt
            and k.device == dev
            and v.device == dev
            and ks[1] == qs[1]
            and vs[1] == qs[1]
            and ks[2] == qs[2]
            and qs[2] > 0
            and vs[2] > 0
            and vs[0] == ks[0]
            # A contiguous tensor has unit stride where it matters, and is_contiguous() reads a cached flag where
            # stride() builds a tuple; stride() then [2] is cheaper than parsing stride(2)'s argument.
            and (q.is_contiguous() or qs[0] == 0 or q.stride()[2] == 1)
            and (k.is_contiguous() or ks[0] == 0 or k.stride()[2] == 1)
            # v is usually a strided view of kv; the fp8 ops also take it key-major (quantize_fp8's key_major)
            and (vs[0] == 0 or v.stride()[2] == 1 or (fp8 and v.stride()[0] == 1))
            and cu_q.dtype is _INT32
            and cu_q.dim() == 1
            and (seqs_1 := cu_q.shape[0]) >= 1
            and cu_q.device == dev
            and type(max_q) is int
            and 0 <= max_q <= MAX_SEQLEN_LIMIT
            and type(softmax_scale) is float
            and math.isfinite(softmax_scale)
            and (
                ks[0] == qs[0]
                if self_attention
                else (
                    cu_k.dtype is _INT32
                    and cu_k.dim() == 1
                    and cu_k.shape[0] == seqs_1
                    and cu_k.device == dev
                    and type(max_k) is int
                    and 0 <= max_k <= MAX_SEQLEN_LIMIT
                )
            )
        )
    except AttributeError:
        return None
    return (dev, dt, qs, ks[0], vs[2], seqs_1) if valid else None


#: The arguments of ``mla.prefill_context_chunk`` in its schema's order: ``(q, k, v, cu_seqlens_q,
#: cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)``.
AttentionInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float]


def check_attention_inputs(op: str, inputs: AttentionInputs, self_attention: bool, fp8: bool = False) -> None:
    """Validate the inputs of ``mla.prefill`` or ``mla.prefill_context_chunk`` without reading data.

    ``inputs`` is :data:`AttentionInputs`. ``self_attention`` selects the ``mla.prefill`` rules: ``k``
    and ``v`` are the new tokens themselves, described by ``cu_seqlens_q`` (pass it as ``cu_seqlens_k``
    too, and ``max_seqlen`` as both bounds). ``fp8``: the rules of ``mla.prefill_fp8`` and
    ``mla.prefill_context_chunk_fp8`` for the same inputs, whose dtype is :data:`~mla_ops.specs.FP8_DTYPE`
    (their scales: :func:`check_fp8_scales`).

    Raises ``TypeError`` for a wrong type or dtype and ``ValueError`` for a wrong shape, device,
    stride or value; each message names the argument and says what to pass instead.
    """
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale = inputs
    if (
        checked_attention_sizes(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, self_attention, fp8
        )
        is not None
    ):
        return
    _check_rank3(op, "q", q, "[T, H, Dqk]")
    _check_rank3(op, "k", k, "[T, H, Dqk]")
    _check_rank3(op, "v", v, "[T, H, Dv]")
    if fp8 and q.dtype != FP8_DTYPE:
        raise TypeError(
            f"{op}: q has dtype {_dtype_name(q.dtype)}; this op takes {_dtype_name(FP8_DTYPE)} q, k and v with their "
            f"descale factors (mla_ops.quantize_fp8 makes both); for {_dtype_name(q.dtype)} inputs call "
            f"{op.removesuffix('_fp8')}"
        )
    if not fp8 and q.dtype not in _DTYPES:
        hint = ""
        if q.dtype == FP8_DTYPE:
            hint = f"; for {_dtype_name(FP8_DTYPE)} inputs with descale factors call {op}_fp8"
        raise TypeError(f"{op}: q has dtype {_dtype_name(q.dtype)}; only bfloat16 and float16 are supported{hint}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(
                f"{op}: {name} has dtype {_dtype_name(t.dtype)} but q has {_dtype_name(q.dtype)}; "
                "q, k and v must share one dtype"
            )
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}; q, k and v must share a device")
    if q.shape[1] == 0:
        raise ValueError(f"{op}: q has 0 heads (shape {tuple(q.shape)}); pass at least one head")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(
            f"{op}: head counts differ: q has {q.shape[1]}, k has {k.shape[1]}, v has {v.shape[1]}; "
            "MLA prefill expands the latent KV to one k/v head per query head"
        )
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"{op}: q has head dim {q.shape[2]} but k has {k.shape[2]}; they must match")
    if q.shape[2] == 0 or v.shape[2] == 0:
        raise ValueError(f"{op}: head dims must be positive, got Dqk={q.shape[2]}, Dv={v.shape[2]}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"{op}: k has {k.shape[0]} tokens but v has {v.shape[0]}; they must match")
    if fp8 and v.numel() > 0 and v.stride(0) == 1 and v.stride(-1) != 1:
        _check_unit_stride(op, ("q", "k"), (q, k))  # key-major values (quantize_fp8(v, key_major=True))
    else:
        _check_unit_stride(op, ("q", "k", "v"), (q, k, v), fp8)
    _check_grad(op, ("q", "k", "v"), (q, k, v))
    if self_attention:
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"{op}: q has {q.shape[0]} tokens but k has {k.shape[0]}; they must match")
        _check_cu_seqlens(op, "cu_seqlens", cu_seqlens_q, q.device)
        check_max_seqlen(op, "max_seqlen", max_seqlen_q)
    else:
        _check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, q.device)
        _check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, q.device)
        if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
            raise ValueError(
                f"{op}: cu_seqlens_q describes {cu_seqlens_q.shape[0] - 1} sequences but cu_seqlens_k "
                f"describes {cu_seqlens_k.shape[0] - 1}; a chunk needs one (possibly empty) entry per sequence"
            )
        check_max_seqlen(op, "max_seqlen_q", max_seqlen_q)
        check_max_seqlen(op, "max_seqlen_k", max_seqlen_k)
    _check_scale(op, softmax_scale)


#: The fp8 ops' descale arguments, in their schemas' order.
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")
#: The shapes a descale factor may have, as the messages name them.
_DESCALE_SHAPES = "[] or [1] (one factor for every head) or [H] (one per head)"


def check_out_dtype(op: str, out_dtype: object) -> None:
    """An fp8 op's ``out_dtype`` must be bfloat16 or float16."""
    if out_dtype not in _DTYPES:
        raise TypeError(f"{op}: out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype!r:.40}")


def check_fp8_scales(op: str, q: torch.Tensor, descales: Sequence[object], out_dtype: object) -> None:
    """Validate an fp8 op's descale factors (``q``'s, ``k``'s and ``v``'s, :data:`DESCALE_NAMES`) and output dtype
    without reading data: each factor a float32 tensor of shape ``[]``, ``[1]`` or ``[H]`` on ``q``'s device, and
    ``out_dtype`` bfloat16 or float16. Call it after :func:`check_attention_inputs` accepted ``q``. Their values
    are checked where they are on the host (:func:`check_fp8_scale_values`)."""
    num_heads = q.shape[1]
    for name, d in zip(DESCALE_NAMES, descales):
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a float32 torch.Tensor {_DESCALE_SHAPES}, got {type(d).__name__}")
        if d.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must have dtype float32, got {_dtype_name(d.dtype)}; use {name}.float()")
        if d.dim() > 1 or (d.dim() == 1 and d.shape[0] not in (1, num_heads)):
            raise ValueError(
                f"{op}: {name} must have shape {_DESCALE_SHAPES} with H = {num_heads} (q's heads), got {tuple(d.shape)}"
            )
        if d.device != q.device:
            raise ValueError(f"{op}: {name} is on {d.device} but q is on {q.device}; move it to {q.device}")
    check_out_dtype(op, out_dtype)


def check_fp8_scale_values(op: str, descales: Sequence[torch.Tensor]) -> None:
    """Each descale factor (:data:`DESCALE_NAMES`) must be finite and positive: this reads them, so call it only
    where they are on the host (a CUDA kernel given a non-finite factor returns NaN rows, as with any non-finite
    input)."""
    for name, d in zip(DESCALE_NAMES, descales):
        bad = d[~(torch.isfinite(d) & (d > 0))]
        if bad.numel():
            raise ValueError(
                f"{op}: {name} must hold finite, positive factors (real value = fp8 value * factor), got "
                f"{bad.flatten()[0].item()}; mla_ops.quantize_fp8 returns valid ones"
            )


def merge_tensors_are_valid(prefix_out, prefix_lse, suffix_out, suffix_lse) -> bool:
    """Whether :func:`check_merge_inputs` would accept these four *tensors*, in one expression, as
    :func:`checked_attention_sizes` for the attention inputs: :func:`check_merge_inputs` asks it first,
    and looks for the problem to report only when it says no."""
    shape, dt, dev = prefix_out.shape, prefix_out.dtype, prefix_out.device
    return (
        len(shape) == 3
        and (dt is _BF16 or dt is _FP16)
        and suffix_out.dtype is dt
        and suffix_out.shape == shape
        and prefix_lse.dtype is _FP32
        and suffix_lse.dtype is _FP32
        and prefix_lse.shape == (shape[1], shape[0])
        and suffix_lse.shape == (shape[1], shape[0])
        and suffix_out.device == dev
        and prefix_lse.device == dev
        and suffix_lse.device == dev
        and (0 in shape or (prefix_out.stride(2) == 1 and suffix_out.stride(2) == 1))
        and not (torch.is_grad_enabled() and (prefix_out.requires_grad or suffix_out.requires_grad))
    )


def check_merge_inputs(
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> None:
    """Validate the inputs of ``mla.merge_attn_states`` without reading data."""
    tensor = torch.Tensor
    all_tensors = (
        isinstance(prefix_out, tensor)
        and isinstance(prefix_lse, tensor)
        and isinstance(suffix_out, tensor)
        and isinstance(suffix_lse, tensor)
    )
    if all_tensors and merge_tensors_are_valid(prefix_out, prefix_lse, suffix_out, suffix_lse):
        return
    op = "mla.merge_attn_states"
    _check_rank3(op, "prefix_out", prefix_out, "[T, H, Dv]")
    _check_rank3(op, "suffix_out", suffix_out, "[T, H, Dv]")
    if prefix_out.dtype not in _DTYPES:
        raise TypeError(
            f"{op}: prefix_out has dtype {_dtype_name(prefix_out.dtype)}; only bfloat16 and float16 are supported"
        )
    if suffix_out.dtype != prefix_out.dtype:
        raise TypeError(
            f"{op}: suffix_out has dtype {_dtype_name(suffix_out.dtype)} but prefix_out has "
            f"{_dtype_name(prefix_out.dtype)}; they must match"
        )
    if suffix_out.shape != prefix_out.shape:
        raise ValueError(
            f"{op}: prefix_out has shape {tuple(prefix_out.shape)} but suffix_out has {tuple(suffix_out.shape)}; "
            "they must match"
        )
    num_tokens, num_heads, _ = prefix_out.shape
    for name, lse in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)):
        if not isinstance(lse, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a float32 torch.Tensor [H, T], got {type(lse).__name__}")
        if lse.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must have dtype float32, got {_dtype_name(lse.dtype)}")
        if lse.dim() != 2 or lse.shape[0] != num_heads or lse.shape[1] != num_tokens:
            raise ValueError(
                f"{op}: {name} must have shape [H, T] = ({num_heads}, {num_tokens}) (head-major), "
                f"got {tuple(lse.shape)}"
            )
    for name, t in (("prefix_lse", prefix_lse), ("suffix_out", suffix_out), ("suffix_lse", suffix_lse)):
        if t.device != prefix_out.device:
            raise ValueError(f"{op}: {name} is on {t.device} but prefix_out is on {prefix_out.device}")
    _check_unit_stride(op, ("prefix_out", "suffix_out"), (prefix_out, suffix_out))
    _check_grad(op, ("prefix_out", "suffix_out"), (prefix_out, suffix_out))


def check_chunk_values(v: torch.Tensor, v_chunk: torch.Tensor) -> None:
    """A context chunk's values must be as wide as the new tokens' (``[.., .., Dv]`` both): the two
    attentions' outputs are merged. Called after both inputs passed :func:`check_attention_inputs`."""
    if v_chunk.shape[2] != v.shape[2]:
        raise ValueError(
            f"mla.prefill_with_chunk: v_chunk has head dim {v_chunk.shape[2]} but v has {v.shape[2]}; a context "
            "chunk's values must be as wide as the new tokens' values"
        )


def check_argument_types(op: str, tensors: dict[str, object], ints: dict[str, object]) -> None:
    """Check Python argument types before they reach the dispatcher, whose own errors name no argument."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, value in ints.items():
        check_max_seqlen(op, name, value)


def check_offsets_start_and_order(op: str, name: str, cu_seqlens: torch.Tensor) -> list[int]:
    """Check that offsets start at 0 and never decrease; returns them as a list. Reads the values."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0:
        raise ValueError(f"{op}: {name} must start at 0, got {bounds[0]}")
    if any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"{op}: {name} must be non-decreasing, got {bounds}")
    return bounds


def check_cu_seqlens_values(op: str, cu_seqlens: torch.Tensor, num_tokens: int, max_seqlen: int, name: str) -> None:
    """Validate the values of ``cu_seqlens``: this reads them, so call it only where they are on the host.

    Requires ``cu_seqlens[0] == 0``, non-decreasing offsets, ``cu_seqlens[-1] <= num_tokens`` (tokens
    past the last offset are padding) and every length ``<= max_seqlen``.
    """
    bounds = check_offsets_start_and_order(op, name, cu_seqlens)
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    if bounds[-1] > num_tokens:
        raise ValueError(
            f"{op}: {name} ends at {bounds[-1]} but the tensor holds only {num_tokens} tokens; "
            f"{name}[-1] must be <= the token count"
        )
    longest = max(lengths, default=0)
    if longest > max_seqlen:
        raise ValueError(
            f"{op}: max_seqlen for {name} is {max_seqlen} but a sequence has {longest} tokens; pass an upper bound"
        )
