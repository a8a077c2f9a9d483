"""The Gluon kernel's fp8 variant on an SM90 GPU (``pytest -m gpu``), called directly through
:func:`mla_ops.kernels.attention_sm90.attention_sm90` with ``scales`` (``attention_triton`` routes large fp8 calls
to it; tests/test_gpu_fp8.py covers the routed ops).

The tests hold it, on the same quantised inputs as the REFERENCE backend, to the fp8 accuracy contract
(tests/fp8_contract.py) and REFERENCE's LSE: ragged causal lengths, a context chunk with an empty key slice and fewer
keys than queries, per-head and per-tensor factors, DeepSeek-like outlier channels, padding rows, sequences starting
on keys that are not multiples of 16; persistent programs carrying their rings and probability buffers from item to
item; neighbours' NaN never reaching a sequence; a CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch
from fp8_contract import Fp8Batch, contract_batch, contract_errors, fp8_batch, fp8_call
from utils import gluon_or_skip

from mla_ops.backends.reference import ReferenceBackend
from mla_ops.kernels import configs

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
SCALE = 192**-0.5
#: Largest LSE error accepted against REFERENCE on the same dequantised inputs, natural log: the scores are e4m3
#: products summed by the tensor cores, where REFERENCE sums them in float32; a lost descale factor, or the
#: probabilities' 2**8 shift left in (8 ln 2 = 5.5), is off by far more.
LSE_TOL = 1e-2
#: (query lengths, key lengths or None for new tokens): causal new tokens of one, thousands and odd lengths; a context
#: chunk whose keys are longer than the queries, empty, and shorter than the queries.
CASES = [([1, 3000, 17, 1100], None), ([1000, 17, 300], [4097, 0, 129])]


@pytest.fixture
def sm90():
    """:mod:`mla_ops.kernels.attention_sm90`; skips off SM90, without Gluon, or under a Triton release the kernel is
    not adapted to."""
    gluon_or_skip(DEVICE)
    from mla_ops.kernels import attention_sm90

    return attention_sm90


def _run(sm90, batch: Fp8Batch, causal: bool, pingpong: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 variant on ``batch``, in the configuration compile_sm90.py compiles (SM90_GLUON_FP8_ATTENTION), with
    its ping-pong flag or ``pingpong``."""
    config = configs.SM90_GLUON_FP8_ATTENTION[(192, 128, causal)]
    reason = sm90.sm90_unsupported_reason(batch.q, batch.k, batch.v, SCALE, config.block_n, config.num_stages)
    assert reason is None, reason
    call, scales = fp8_call(batch, causal, SCALE)
    pingpong = config.pingpong if pingpong is None else pingpong
    return sm90.attention_sm90(
        call, block_n=config.block_n, stages=config.num_stages, scales=scales, pingpong=pingpong
    )  # fmt: skip


@pytest.mark.parametrize(("lengths", "key_lengths"), CASES, ids=["causal", "chunk"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize(("per_head", "outliers"), [(True, True), (False, False)])
def test_gluon_fp8_meets_the_contract(sm90, lengths, key_lengths, heads, per_head, outliers) -> None:
    batch, causal = contract_batch(lengths, key_lengths, heads, per_head, outliers, DEVICE)
    out, lse = _run(sm90, batch, causal)
    tokens = batch.q.shape[0]
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, heads, 128) and lse.shape == (heads, tokens)
    error, bound = contract_errors(batch, out, causal, SCALE)
    assert error <= bound, f"error {error:.4f} exceeds the contract's {bound:.4f}"
    rows = int(batch.cu_seqlens_q[-1])
    assert torch.isneginf(lse[:, rows:]).all(), "padding rows get lse = -inf"
    assert torch.isfinite(out[:rows]).all()
    _, want_lse = ReferenceBackend().attention_fp8(*fp8_call(batch, causal, SCALE))
    lse, want_lse = lse[:, :rows], want_lse[:, :rows]
    no_key = torch.isneginf(want_lse)  # the query rows of an empty key slice
    assert torch.equal(torch.isneginf(lse), no_key), "lse = -inf exactly where a row sees no key"
    assert (out[:rows].transpose(0, 1)[no_key] == 0).all(), "out = 0 where a row sees no key"
    lse_error = (lse[~no_key] - want_lse[~no_key]).abs().max().item()
    assert lse_error <= LSE_TOL, f"lse error {lse_error:.5f} against REFERENCE"


@pytest.mark.parametrize(
    ("lengths", "key_lengths"),
    [([8, 8], None), ([1, 17], None), ([32, 5, 16], None), ([200, 17], None), ([64, 9], [33, 48])],
    ids=["8+8", "1+17", "32+5+16", "200+17", "chunk-33+48"],
)
def test_gluon_fp8_sequences_start_on_any_key(sm90, lengths, key_lengths) -> None:
    """Sequences whose keys start at offsets that are not multiples of 16: the transposed values place each sequence
    on an aligned column (a TMA load must start on a 16-byte boundary in the contiguous dimension; unaligned, these
    batches stopped on an illegal instruction on an H100), and the results meet the contract."""
    causal = key_lengths is None
    batch = fp8_batch(lengths, key_lengths, 16, padding=3, device=DEVICE)
    out, lse = _run(sm90, batch, causal)
    error, bound = contract_errors(batch, out, causal, SCALE)
    assert error <= bound, f"error {error:.4f} exceeds the contract's {bound:.4f}"
    rows = int(batch.cu_seqlens_q[-1])
    _, want_lse = ReferenceBackend().attention_fp8(*fp8_call(batch, causal, SCALE))
    lse_error = (lse[:, :rows] - want_lse[:, :rows]).abs().max().item()
    assert lse_error <= LSE_TOL, f"lse error {lse_error:.5f} against REFERENCE"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_gluon_fp8_persistent_programs_carry_their_rings(sm90, monkeypatch, causal, programs) -> None:
    """A few persistent programs, each taking dozens of work items in turn (whole and partial blocks, slots no block
    fills, empty key sets): the rings' phases, the probability buffers' alternation and the value descriptor each
    item rewrites carry from item to item, so the results equal those of one program per multiprocessor, bit for
    bit (each item is computed alike whichever program takes it)."""
    lengths = [300, 1, 0, 129, 1000, 64, 7]
    key_lengths = None if causal else [513, 40, 9, 0, 1000, 128, 3]
    batch = fp8_batch(lengths, key_lengths, 8, padding=9, seed=2, device=DEVICE)
    want_out, want_lse = _run(sm90, batch, causal)
    monkeypatch.setattr(sm90, "_multiprocessors", lambda index: programs)
    out, lse = _run(sm90, batch, causal)
    rows = int(batch.cu_seqlens_q[-1])
    assert torch.equal(out[:rows], want_out[:rows]) and torch.equal(lse, want_lse)
    error, bound = contract_errors(batch, out, causal, SCALE)
    assert error <= bound, f"error {error:.4f} exceeds the contract's {bound:.4f}"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
@pytest.mark.parametrize("programs", [1, 3, None])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_gluon_pingpong_turns_change_no_bit(sm90, monkeypatch, causal, programs, fp8) -> None:
    """The consumers taking turns ('pp') changes when each warpgroup issues its products, not what it computes: the
    results equal those without turns bit for bit, on ragged batches where the two warpgroups of a causal item see
    different numbers of key tiles (the one that sees fewer keeps taking turns on the tiles it hands back, or the
    other would wait forever), with empty key sets, and with a few persistent programs taking many items each (the
    turns' phases carry from item to item). bf16 too: the flag is the kernel's, whatever the dtype."""
    lengths = [300, 1, 0, 129, 1000, 64, 7, 2500]
    key_lengths = None if causal else [513, 40, 9, 0, 1000, 128, 3, 700]
    batch = fp8_batch(lengths, key_lengths, 8, padding=9, seed=3, device=DEVICE)
    if programs is not None:
        monkeypatch.setattr(sm90, "_multiprocessors", lambda index: programs)
    if fp8:
        results = [_run(sm90, batch, causal, pingpong) for pingpong in (False, True)]
    else:
        call, _ = fp8_call(batch, causal, SCALE)
        q, k, v = (x.to(torch.bfloat16) for x in call[:3])  # e4m3 values are bf16 values
        call = call._replace(q=q * SCALE**0.5, k=k * SCALE**0.5, v=v)
        config = configs.SM90_LARGE_BATCH_ATTENTION[(192, 128, causal)]
        results = [
            sm90.attention_sm90(call, block_n=config.block_n, stages=config.num_stages, pingpong=pingpong)
            for pingpong in (False, True)
        ]  # fmt: skip
    (want_out, want_lse), (out, lse) = results
    rows = int(batch.cu_seqlens_q[-1])
    assert torch.isfinite(out[:rows]).all()
    assert torch.equal(out[:rows], want_out[:rows]) and torch.equal(lse, want_lse)


@pytest.mark.parametrize(("lengths", "key_lengths"), CASES, ids=["causal", "chunk"])
def test_gluon_fp8_isolates_sequences(sm90, lengths, key_lengths) -> None:
    """e4m3 NaN (0x7F) in one sequence's keys and values, and in the rows past ``cu_seqlens_k[-1]``, changes no bit of
    the other sequences' results: key tiles past a sequence are masked in the scores, and value tiles are loaded
    through a descriptor that ends at the sequence's last key (zeros past it, where ``0 * NaN`` would be NaN)."""
    causal = key_lengths is None
    batch = fp8_batch(lengths, key_lengths, 16, padding=7, device=DEVICE)
    want_out, want_lse = _run(sm90, batch, causal)
    cu_q, cu_k = batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist()
    poisoned = 1
    for start, end in ((cu_k[poisoned], cu_k[poisoned + 1]), (cu_k[-1], batch.k.shape[0])):
        batch.k.view(torch.uint8)[start:end] = 0x7F
        batch.v.view(torch.uint8)[start:end] = 0x7F
    out, lse = _run(sm90, batch, causal)
    for b in range(len(lengths)):
        if b != poisoned:
            rows = slice(cu_q[b], cu_q[b + 1])
            assert torch.equal(out[rows], want_out[rows]) and torch.equal(lse[:, rows], want_lse[:, rows]), b


def test_gluon_fp8_replays_in_a_cuda_graph(sm90) -> None:
    """Captured once (the transposed copy of the values, the item counter's memset and the kernel, with its device-side
    descriptors' scratch from the graph's pool), replayed on new data and factors in the same buffers."""
    lengths, causal = [700, 3, 1500], True
    batch = fp8_batch(lengths, None, 16, padding=5, seed=3, device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(sm90, batch, causal)  # compile before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = _run(sm90, batch, causal)
    fresh = fp8_batch(lengths, None, 16, padding=5, seed=4, device=DEVICE)
    for static, new in zip((batch.q, batch.k, batch.v, *batch.descales), (fresh.q, fresh.k, fresh.v, *fresh.descales)):
        static.copy_(new)
    graph.replay()
    want_out, want_lse = _run(sm90, batch, causal)
    rows = sum(lengths)
    assert torch.equal(out[:rows], want_out[:rows]) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
def test_gluon_fp8_relaunches_its_layout_on_new_tensors(sm90, attention_launches, causal) -> None:
    """attention_triton routes these fp8 calls to the Gluon kernel; a layout's first launch goes through Triton's
    dispatch, its second through the compiled variants (copy and kernel), and every later one through the
    remembered TransposedRelaunch, with only the addresses, a fresh transposed copy and a fresh work counter
    replaced: each call, on new tensors with new lengths, equals the kernel called directly."""
    from mla_ops.kernels.attention import attention_triton

    lengths_q = [[700, 3, 0, 3905], [5, 4000, 7, 596], [1, 1, 4605, 1], [2304, 2304, 0, 0]]
    lengths_k = [[5000, 3, 0, 97], [9, 4000, 2, 1089], [4096, 0, 1, 1003], [0, 5100, 0, 0]]
    config = configs.SM90_GLUON_FP8_ATTENTION[(192, 128, causal)]
    for i, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        batch = fp8_batch(lq, None if causal else lk, 16, seed=i, device=DEVICE)
        call, scales = fp8_call(batch, causal, SCALE)
        # Equal totals and bounds: one layout.
        call = call._replace(max_seqlen_q=4608, max_seqlen_k=4608 if causal else 5100)
        if i >= 2:
            known = list(attention_launches.known.values())
            assert len(known) == 1 and isinstance(known[0].launch, sm90.TransposedRelaunch), (
                "the second call's launch is remembered, with its copy"
            )
        out, lse = attention_triton(call, scales=scales)
        want_out, want_lse = sm90.attention_sm90(call, block_n=config.block_n, stages=config.num_stages, scales=scales)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse), i


def _key_major(v: torch.Tensor, poison: int = 0) -> torch.Tensor:
    """``v`` ``[T, H, D]`` as a key-major view of a ``[H, D, W]`` tensor (``W`` = T rounded up to 16), the layout of
    ``quantize_fp8(v, key_major=True)``; its columns past ``T - poison`` hold e4m3 NaN (0x7F)."""
    tokens, heads, dim = v.shape
    storage = torch.zeros(heads, dim, -(-tokens // 16) * 16, dtype=v.dtype, device=v.device)
    storage[..., :tokens] = v.permute(1, 2, 0)
    storage.view(torch.uint8)[..., tokens - poison :] = 0x7F
    return storage[..., :tokens].permute(2, 0, 1)


@pytest.mark.parametrize(
    ("lengths", "key_lengths"),
    [([1], None), ([50], None), ([4100], None), ([300], [40]), ([700], [5000]), ([2], [0])],
    ids=["causal-1", "causal-50", "causal-4100", "chunk-40", "chunk-5000", "chunk-empty"],
)
def test_gluon_fp8_reads_key_major_values_of_one_sequence(sm90, lengths, key_lengths) -> None:
    """A one-sequence call's key-major values (quantize_fp8's key_major layout) are read as they are, without the
    transposed copy, and give the copy's results bit for bit: fewer keys than one tile, a last tile cut short, an
    empty chunk. The descriptor ends at the sequence's last key: NaN in the padding rows past it changes no bit."""
    causal = key_lengths is None
    batch = fp8_batch(lengths, key_lengths, 16, padding=9, seed=5, device=DEVICE)
    want_out, want_lse = _run(sm90, batch, causal)
    rows = int(batch.cu_seqlens_q[-1])
    key_major = _key_major(batch.v, poison=batch.v.shape[0] - int(batch.cu_seqlens_k[-1]))
    # Values of no rows (an empty chunk) take the copy, which has nothing to copy.
    assert sm90.values_read_directly(key_major, 1) == (key_major.shape[0] > 0)
    batch.v = key_major
    out, lse = _run(sm90, batch, causal)
    assert torch.equal(out[:rows], want_out[:rows]) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
def test_gluon_fp8_key_major_values_through_the_ops(causal) -> None:
    """Through the fp8 ops (TRITON): values quantised key-major (mla_ops.quantize_fp8(v, key_major=True)) give the
    token-major results bit for bit, read directly for one sequence (three calls: the JIT launch, the compiled
    variant, the remembered DirectRelaunch) and made token-major first for a ragged batch."""
    import mla_ops
    from mla_ops.kernels.attention import LAUNCHES
    from mla_ops.kernels.attention_sm90 import DirectRelaunch

    gluon_or_skip(DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(7)
    for lengths, key_lengths in [([3000], [4100]), ([900, 5, 2100], [1000, 17, 3000])]:
        for step in range(3 if len(lengths) == 1 else 1):
            tq = sum(lengths)
            tk = tq if causal else sum(key_lengths)
            q, k = (torch.randn(t, 128, 192, device=DEVICE, generator=generator) for t in (tq, tk))
            v = torch.randn(tk, 128, 256, device=DEVICE, generator=generator)[..., 128:]
            (q8, dq), (k8, dk) = mla_ops.quantize_fp8(q), mla_ops.quantize_fp8(k)
            v8, dv = mla_ops.quantize_fp8(v)
            v8_keys, dv_keys = mla_ops.quantize_fp8(v, key_major=True)
            assert v8_keys.stride(0) == 1 and torch.equal(dv_keys, dv)
            cu_q = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
            keys = lengths if causal else key_lengths
            cu_k = torch.tensor([0, *torch.tensor(keys).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
            results = []
            with mla_ops.prefill_backend("TRITON"):
                for values in (v8, v8_keys):
                    if causal:
                        results.append(mla_ops.prefill_fp8(q8, k8, values, cu_q, max(lengths), dq, dk, dv, SCALE))
                    else:
                        results.append(
                            mla_ops.prefill_context_chunk_fp8(
                                q8, k8, values, cu_q, cu_k, max(lengths), max(keys), dq, dk, dv, SCALE
                            )
                        )  # fmt: skip
            (want_out, want_lse), (out, lse) = results
            assert torch.equal(out, want_out) and torch.equal(lse, want_lse), (lengths, step)
            if len(lengths) == 1 and step == 2:
                assert any(isinstance(known.launch, DirectRelaunch) for known in LAUNCHES.known.values())


def test_gluon_fp8_key_major_values_replay_in_a_cuda_graph(sm90) -> None:
    """Quantisation of v key-major and the fp8 op on it, captured once for one sequence of up to 4096 tokens (the
    Gluon kernel reading v directly, a DirectRelaunch after the warm-up calls) and replayed with new data and a new
    length in the same buffers: the results of calling it again, bit for bit."""
    import mla_ops

    heads, budget = 32, 4096
    x = torch.zeros(3, budget, heads, 320, dtype=torch.bfloat16, device=DEVICE)  # q, k and kv
    cu = torch.zeros(2, dtype=torch.int32, device=DEVICE)

    def step():
        (q8, dq), (k8, dk) = mla_ops.quantize_fp8(x[0][..., :192]), mla_ops.quantize_fp8(x[1][..., :192])
        v8, dv = mla_ops.quantize_fp8(x[2][..., 192:], key_major=True)
        assert sm90.values_read_directly(v8, 1)
        with mla_ops.prefill_backend("TRITON"):
            return mla_ops.prefill_fp8(q8, k8, v8, cu, budget, dq, dk, dv, SCALE)

    def load(length, seed):
        x.copy_(torch.randn(x.shape, generator=torch.Generator(DEVICE).manual_seed(seed), device=DEVICE))
        cu.copy_(torch.tensor([0, length], dtype=torch.int32))

    load(3000, 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # the JIT launch, the compiled variant, the remembered relaunch
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for seed, length in enumerate([4096, 129, 1], start=1):
        load(length, seed)
        graph.replay()
        want_out, want_lse = step()
        assert torch.equal(out[:length], want_out[:length]) and torch.equal(lse[:, :length], want_lse[:, :length])
