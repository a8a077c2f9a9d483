"""FLASHINFER on SM100: FlashInfer's trtllm-gen DeepSeek ragged kernel, ``trtllm_ragged_attention_deepseek``.

This is the kernel the seed's TRTLLM_RAGGED backend runs (vLLM's backend is a thin wrapper over the same
function). Here it is one more kernel of the FLASHINFER backend, chosen for eager calls on SM100 where it
serves the call, behind the same plan-once-per-batch interface as the ragged wrapper's kernels:
:class:`TrtllmRaggedWrapper` has the wrapper's ``plan()``/``run()`` shape, so the backend's plan cache,
wrapper pool and padding-row handling apply to it unchanged.

**Not run on hardware by this project**: no Blackwell GPU was available. Everything below comes from
flashinfer-python 0.7.2.post1's own source (``flashinfer/prefill.py``, ``csrc/trtllm_fmha_kernel_launcher.cu``,
``include/flashinfer/trtllm/fmha/lse.cuh``) and FlashInfer's tests of the function, and is exercised here
against a stand-in with the real signature (tests/standins.py).

What the library documents, and what this module does about it:

- **Head dims and dtypes.** The function asserts ``(Dqk, Dv)`` in ``(192, 128)`` (DeepSeek), ``(128, 128)``
  and ``(256, 256)`` (:data:`TRTLLM_HEAD_DIMS`). FlashInfer tests it in bf16 only (plus fp8 inputs, which
  this package does not take), and its fp16-softmax variant is documented "BF16 Q/KV/O only", so it serves
  bf16 (:data:`TRTLLM_DTYPES`); fp16 stays on the ragged wrapper's kernels. The cubins are built for SM100
  and SM103 (compute capability 10.x).
- **LSE.** The launcher fixes ``lseScale = 1``, and ``ComputeLSEFromMD`` writes ``log2(e) * m + log2(d)``:
  base 2, ``[T, H]``, the same convention as the ragged wrapper's kernels (FlashInfer's test compares the
  two directly). The backend converts it to natural log, ``[H, T]``, exactly as it does theirs.
- **Layouts.** The launcher passes strides for ``k`` and ``v`` but none for ``q`` and ``out``, which the
  kernel reads as packed ``[T, H, D]``: ``q`` is made contiguous when it is not (``v`` as a strided view of
  ``kv_nope`` is passed as it is). ``q`` and ``out`` are cut to the rows the batch covers.
- **Empty sequences.** By default the function "assumes every row has positive query and KV lengths"; a
  sequence with no keys (an empty context chunk) or no queries takes an undefined kernel path. The plan
  knows the lengths on the host, so a batch where every sequence has both runs the kernel directly. For a
  batch with an empty one, the plan builds, once, device index tensors of the rows of the sequences that
  have both; each call gathers those rows, runs the kernel on that all-active batch, scatters the results
  back and writes ``out = 0``, ``lse = -inf`` into the rows of sequences without keys. This is the
  compaction the function performs itself when given its ``q_seq_lens_cpu``/``kv_seq_lens_cpu`` mirrors,
  with the host work moved from every call to the plan: a planned call reads nothing on the host.
- **Workspace.** FlashInfer's tests give the trtllm-gen kernels a zero-initialised workspace of their own,
  separate from the ragged wrapper's float workspace, and the launcher carves the LSE's softmax statistics
  out of it: ``8 * H * B * roundup(max_q, 256)`` bytes plus a 1 MiB guard, failing the call when the
  buffer is smaller. :class:`TrtllmWorkspaces` keeps one zeroed buffer per device and grows it to what
  each plan needs (:func:`workspace_bytes_needed`).
- **Graph rules.** Planning reads the offsets on the host, like the wrapper's kernels (the FLASHINFER
  backend ``plans_on_host``). CUDA graphs do not use this kernel: a graph's padding sequences have length 0,
  and the compaction that makes such a batch correct is built on the host for each batch, which a replay
  with other lengths cannot follow. Inside graphs the backend keeps the ragged wrapper's fa2 kernel, as before.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..specs import DeviceCapability

#: FlashInfer's name for the kernel family; the FLASHINFER backend's kernel name for this path.
TRTLLM_KERNEL = "trtllm-gen"

#: ``(Dqk, Dv)`` pairs ``trtllm_ragged_attention_deepseek`` accepts (its head-dimension assertion).
TRTLLM_HEAD_DIMS: frozenset[tuple[int, int]] = frozenset({(192, 128), (128, 128), (256, 256)})

#: The dtypes served: FlashInfer tests the function in bf16 (and fp8, which this package does not take).
TRTLLM_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16,)

#: The keyword parameters this module passes; a FlashInfer whose function lacks one is too old for it.
_REQUIRED_KEYWORDS = ("out", "lse")

#: The launcher's trailing guard after the softmax statistics (``kTrtllmGenSoftmaxStatsGuardBytes``).
_SOFTMAX_STATS_GUARD_BYTES = 1 << 20
#: The launcher rounds each sequence's query length up to this many rows when it sizes those statistics.
_SOFTMAX_STATS_ROWS = 256
#: Room for the allocator's 16-byte alignment of the statistics and of the (empty) scratch after them.
_ALIGNMENT_SLACK = 256


def trtllm_function(library: Any) -> tuple[Any, str | None]:
    """``(trtllm_ragged_attention_deepseek, None)`` from an imported ``flashinfer``, or ``(None, why not)``."""
    version = getattr(library, "__version__", "(unknown version)")
    function = getattr(getattr(library, "prefill", None), "trtllm_ragged_attention_deepseek", None)
    if function is None:
        return None, f"flashinfer {version} has no prefill.trtllm_ragged_attention_deepseek"
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a signature hidden by a C extension: trust the version pin
        return function, None
    missing = [name for name in _REQUIRED_KEYWORDS if name not in params]
    if missing:
        return None, f"flashinfer {version}'s trtllm_ragged_attention_deepseek lacks {', '.join(missing)}"
    return function, None


def trtllm_serves(capability: DeviceCapability | None, head_dim_qk: int, head_dim_v: int, dtype: torch.dtype) -> bool:
    """Whether the trtllm-gen DeepSeek kernel serves ``(dtype, Dqk, Dv)`` on a device of ``capability``.

    A pure rule (whether FlashInfer is installed is asked elsewhere): compute capability 10.x, a CUDA 12.8
    build of torch where torch has one (FlashInfer's SM100 gate), :data:`TRTLLM_HEAD_DIMS`, :data:`TRTLLM_DTYPES`.
    """
    if capability is None or capability.major != 10:
        return False
    if (head_dim_qk, head_dim_v) not in TRTLLM_HEAD_DIMS or dtype not in TRTLLM_DTYPES:
        return False
    version = torch.version.cuda
    if not version:  # a CPU build of torch: the capability is simulated and the gate is moot
        return True
    parts = version.split(".")
    return (int(parts[0]), int(parts[1]) if len(parts) > 1 else 0) >= (12, 8)


def workspace_bytes_needed(num_heads: int, batch_size: int, max_seqlen_q: int) -> int:
    """The workspace one call needs: the launcher's softmax statistics (a float2 per head, sequence and
    query row rounded up to 256 per sequence), its guard, and alignment."""
    rows = -(-max_seqlen_q // _SOFTMAX_STATS_ROWS) * _SOFTMAX_STATS_ROWS
    return 8 * num_heads * batch_size * rows + _SOFTMAX_STATS_GUARD_BYTES + _ALIGNMENT_SLACK


class TrtllmWorkspaces:
    """One zero-initialised workspace per device for the trtllm-gen kernel, grown on demand.

    Args:
        minimum_bytes: the size of a new buffer when a plan needs less.
    """

    def __init__(self, minimum_bytes: int) -> None:
        self.minimum_bytes = minimum_bytes
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` on ``device`` (a larger one replaces a smaller one: eager
        calls on one stream only, so the caching allocator keeps the old one alive for queued kernels)."""
        buffer = self._buffers.get(device)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.zeros(max(nbytes, self.minimum_bytes), dtype=torch.uint8, device=device)
            self._buffers[device] = buffer
        return buffer


@dataclass
class _Compaction:
    """The rows of a batch's sequences that have both queries and keys, as device index tensors."""

    q_rows: torch.Tensor  # int64 [n_active]: the query rows of those sequences
    kv_rows: torch.Tensor  # int64 [kv_active]: their key rows
    keyless_rows: torch.Tensor | None  # int64: query rows of sequences without keys (out 0, lse -inf), or None


@dataclass
class _Plan:
    num_rows: int  # qo_indptr[-1]: the query rows the batch covers
    num_kv_rows: int  # kv_indptr[-1]
    batch_size: int  # of the batch the kernel sees: the sequences with queries and keys
    max_q_len: int  # the exact longest lengths among them, read on the host when planning
    max_kv_len: int
    cum_q: torch.Tensor  # int32 [B+1] on the device, of the batch the kernel sees
    cum_kv: torch.Tensor
    seq_lens: torch.Tensor  # int32 [B] on the device: each sequence's key count
    compaction: _Compaction | None  # None when every sequence has queries and keys
    causal: bool
    sm_scale: float
    workspace_bytes: int


def _rows(indptr: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """The rows ``[indptr[b], indptr[b + 1])`` of the sequences ``b`` where ``selected`` (host tensors)."""
    starts, ends = indptr[:-1][selected].tolist(), indptr[1:][selected].tolist()
    pieces = [torch.arange(a, b) for a, b in zip(starts, ends)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[0, cumsum(lengths)]`` as int32 (host)."""
    return torch.cat((torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths, 0).to(torch.int32)))


class TrtllmRaggedWrapper:
    """``trtllm_ragged_attention_deepseek`` behind ``BatchPrefillWithRaggedKVCacheWrapper``'s ``plan()``/``run()``.

    Args:
        function: ``flashinfer.prefill.trtllm_ragged_attention_deepseek`` (or a stand-in with its signature).
        workspaces: where the kernel's zeroed workspace comes from.
        device: the device the wrapper's calls run on.
    """

    def __init__(self, function: Any, workspaces: TrtllmWorkspaces, device: torch.device) -> None:
        self.device = device
        self._function = function
        self._workspaces = workspaces
        self._plan: _Plan | None = None

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int | None = None,
        *,
        causal: bool = False,
        sm_scale: float | None = None,
        q_data_type: torch.dtype = torch.bfloat16,
        kv_data_type: torch.dtype | None = None,
        o_data_type: torch.dtype | None = None,
    ) -> None:
        """Read a batch's offsets (int32 ``[B+1]`` host tensors) into what every ``run()`` of it passes."""
        head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
        if (head_dim_qk, head_dim_vo) not in TRTLLM_HEAD_DIMS or q_data_type not in TRTLLM_DTYPES:
            raise ValueError(
                f"trtllm_ragged_attention_deepseek does not serve {q_data_type} with (Dqk, Dv) = "
                f"({head_dim_qk}, {head_dim_vo}); it serves {sorted(TRTLLM_HEAD_DIMS)} in bfloat16"
            )
        if num_qo_heads != num_kv_heads:
            raise ValueError(f"MLA prefill has as many key heads as query heads, got {num_qo_heads} and {num_kv_heads}")
        q_lens = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int32)
        kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)
        active = (q_lens > 0) & (kv_lens > 0)
        compaction = None
        if bool(active.all()):
            cum_q_host, cum_kv_host = qo_indptr.to(torch.int32), kv_indptr.to(torch.int32)
        else:  # the kernel sees only the sequences with queries and keys (see the module docstring)
            keyless = (q_lens > 0) & (kv_lens == 0)
            compaction = _Compaction(
                q_rows=_rows(qo_indptr, active).to(self.device),
                kv_rows=_rows(kv_indptr, active).to(self.device),
                keyless_rows=_rows(qo_indptr, keyless).to(self.device) if bool(keyless.any()) else None,
            )
            q_lens, kv_lens = q_lens[active], kv_lens[active]
            cum_q_host, cum_kv_host = _offsets(q_lens), _offsets(kv_lens)
        batch_size = q_lens.numel()
        max_q_len = int(q_lens.max()) if batch_size else 0
        cum_q = cum_q_host.to(self.device)
        same = torch.equal(cum_q_host, cum_kv_host)  # the new-tokens path: one offsets array
        self._plan = _Plan(
            num_rows=int(qo_indptr[-1]),
            num_kv_rows=int(kv_indptr[-1]),
            batch_size=batch_size,
            max_q_len=max_q_len,
            max_kv_len=int(kv_lens.max()) if batch_size else 0,
            cum_q=cum_q,
            cum_kv=cum_q if same else cum_kv_host.to(self.device),
            seq_lens=kv_lens.to(self.device),
            compaction=compaction,
            causal=causal,
            sm_scale=float(head_dim_qk**-0.5 if sm_scale is None else sm_scale),
            workspace_bytes=workspace_bytes_needed(num_qo_heads, batch_size, max_q_len),
        )

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor,
        return_lse: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the planned batch: ``q`` ``[n, H, Dqk]`` with ``n = qo_indptr[-1]``; ``k``/``v`` hold
        at least ``kv_indptr[-1]`` rows. Writes ``out`` (``[n, H, Dv]`` contiguous, q's dtype) and FlashInfer's
        base-2 LSE into ``lse`` (float32 ``[n, H]``) and returns both."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("TrtllmRaggedWrapper.run() called before plan()")
        if not return_lse:
            raise ValueError("the MLA merge needs the LSE: call run() with return_lse=True")
        if q.shape[0] != plan.num_rows:
            raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match qo_indptr[-1] ({plan.num_rows})")
        compaction = plan.compaction
        if compaction is None:
            if not q.is_contiguous():  # the launcher takes no strides for q: the kernel reads it packed
                q = q.contiguous()
            self._launch(q, k[: plan.num_kv_rows], v[: plan.num_kv_rows], out, lse)
            return out, lse
        if compaction.keyless_rows is not None:
            out.index_fill_(0, compaction.keyless_rows, 0.0)
            lse.index_fill_(0, compaction.keyless_rows, -math.inf)
        if plan.batch_size == 0:  # no sequence has both queries and keys
            return out, lse
        q_c = q.index_select(0, compaction.q_rows)  # contiguous: gathered rows are packed
        out_c = torch.empty((q_c.shape[0], q.shape[1], out.shape[2]), dtype=out.dtype, device=out.device)
        lse_c = torch.empty((q_c.shape[0], q.shape[1]), dtype=lse.dtype, device=lse.device)
        k_c, v_c = k.index_select(0, compaction.kv_rows), v.index_select(0, compaction.kv_rows)
        self._launch(q_c, k_c, v_c, out_c, lse_c)
        out.index_copy_(0, compaction.q_rows, out_c)
        lse.index_copy_(0, compaction.q_rows, lse_c)
        return out, lse

    def _launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        """One call of the function on the planned (all-active) batch."""
        plan = self._plan
        assert plan is not None
        workspace = self._workspaces.get(self.device, plan.workspace_bytes)
        self._function(
            q,
            k,
            v,
            workspace,
            plan.seq_lens,
            plan.max_q_len,
            plan.max_kv_len,
            plan.sm_scale,  # bmm1_scale: the softmax scale (no fp8 dequantisation scales here)
            1.0,  # bmm2_scale
            1.0,  # o_sf_scale: only read for fp4 output
            plan.batch_size,
            -1,  # window_left: no sliding window
            plan.cum_q,
            plan.cum_kv,
            False,  # enable_pdl: as vLLM calls it; the package's next kernels do not wait on PDL
            plan.causal,
            True,  # return_lse
            out=out,
            lse=lse,
        )
