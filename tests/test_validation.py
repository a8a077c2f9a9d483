"""Bad inputs to the helpers around the ops, and raw op calls that torch itself parses: each gets one clear
line that names the argument, what was passed and what to pass (or the right result).

The ops' own inputs are in tests/test_errors.py, the command line's in tests/test_cli.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from utils import cu_seqlens_of, make_batch, make_qkv

import mla_ops
from mla_ops import native
from mla_ops.cli.info import check_settings, setting_problems
from mla_ops.kernels import configs
from mla_ops.model import LatentChunk, MLAAttention, MLAConfig, pack_context

BF16 = torch.bfloat16


def _new_tokens():
    return make_batch([3, 4], 2, 192, 128, BF16)


def _chunk(lengths, offsets=None, max_seqlen=None, seed=0):
    """A context chunk of ``lengths`` rows per sequence, with ``offsets`` in place of its own if given."""
    _, k, v = make_qkv(sum(lengths), 2, 192, 128, BF16, generator=torch.Generator().manual_seed(seed))
    cu = cu_seqlens_of(lengths) if offsets is None else offsets
    return mla_ops.ContextChunk(k, v, cu, max(lengths) if max_seqlen is None else max_seqlen)


def _refused(error, message, fn, *args, **kwargs):
    with pytest.raises(error, match=re.escape(message)) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value), "an error is one line"
    return info.value


# --- pack_chunks: the offsets of each chunk, named by the chunk's index ----------------------------------------


PACK_CASES = [
    (
        "float offsets are refused, not truncated",
        [_chunk([6, 0, 7], torch.tensor([0.6, 5.6, 5.6, 12.6]))],
        TypeError,
        "pack_chunks: chunks[0].cu_seqlens_k must have dtype int32, got float32; offsets count rows",
    ),
    (
        "int64 offsets",
        [_chunk([6, 0, 7], torch.tensor([0, 6, 6, 13]))],
        TypeError,
        "pack_chunks: chunks[0].cu_seqlens_k must have dtype int32, got int64",
    ),
    (
        "offsets of another length than cu_seqlens",
        [_chunk([2, 2]), _chunk([1, 2, 3], cu_seqlens_of([1, 2, 3, 0]))],
        ValueError,
        "pack_chunks: chunks[1].cu_seqlens_k must be a 1-D tensor of 3 entries (one per sequence of cu_seqlens, "
        "and 0 first), got shape (5,)",
    ),
    (
        "chunks whose offsets differ in length",
        [_chunk([2, 2]), _chunk([2, 2], cu_seqlens_of([1, 1, 2]))],
        ValueError,
        "pack_chunks: chunks[1].cu_seqlens_k must be a 1-D tensor of 3 entries",
    ),
    (
        "2-D offsets",
        [_chunk([2, 2], cu_seqlens_of([2, 2])[None])],
        ValueError,
        "pack_chunks: chunks[0].cu_seqlens_k must be a 1-D tensor of 3 entries (one per sequence of cu_seqlens, "
        "and 0 first), got shape (1, 3)",
    ),
    (
        "decreasing offsets in chunk 1, reported as passed",
        [_chunk([2, 2]), _chunk([7, 3], torch.tensor([0, 7, 3], dtype=torch.int32), max_seqlen=7)],
        ValueError,
        "pack_chunks: chunks[1]: cu_seqlens_k must be non-decreasing, got [0, 7, 3]",
    ),
    (
        "offsets not from 0",
        [_chunk([2, 2], torch.tensor([1, 2, 4], dtype=torch.int32))],
        ValueError,
        "pack_chunks: chunks[0]: cu_seqlens_k must start at 0, got 1",
    ),
    (
        "offsets past the chunk's rows",
        [_chunk([2, 2], torch.tensor([0, 2, 9], dtype=torch.int32), max_seqlen=7)],
        ValueError,
        "pack_chunks: chunks[0]: cu_seqlens_k ends at 9 but the tensor holds only 4 tokens; "
        "cu_seqlens_k[-1] must be <= the token count",
    ),
    (
        "max_seqlen_k below the longest slice",
        [_chunk([2, 5], max_seqlen=3)],
        ValueError,
        "pack_chunks: chunks[0]: max_seqlen for cu_seqlens_k is 3 but a sequence has 5 tokens; pass an upper bound",
    ),
    (
        "negative max_seqlen_k",
        [_chunk([2, 5], max_seqlen=-1)],
        ValueError,
        "pack_chunks: chunks[0]: max_seqlen_k must be >= 0, got -1",
    ),
    (
        "offsets that are not a tensor",
        [_chunk([2, 2], [0, 2, 4])],
        TypeError,
        "pack_chunks: chunks[0].cu_seqlens_k must be an int32 torch.Tensor [B+1], got list",
    ),
]


@pytest.mark.parametrize(("name", "chunks", "error", "message"), PACK_CASES, ids=[c[0] for c in PACK_CASES])
def test_pack_chunks_names_the_chunk_at_fault(name, chunks, error, message) -> None:
    b = _new_tokens()
    _refused(error, message, mla_ops.pack_chunks, b.k, b.v, b.cu_seqlens, chunks)


def test_pack_chunks_refuses_chunk_tensors_of_another_dtype_or_row_count() -> None:
    b = _new_tokens()
    chunk = _chunk([2, 2])
    _refused(
        ValueError,
        "pack_chunks: chunks[0]: v is float16 on cpu, but the new tokens' v is bfloat16 on cpu",
        mla_ops.pack_chunks, b.k, b.v, b.cu_seqlens, [chunk._replace(v=chunk.v.half())],
    )  # fmt: skip
    _refused(
        ValueError,
        "pack_chunks: chunks[0]: k has 4 rows but v has 3; they must match",
        mla_ops.pack_chunks, b.k, b.v, b.cu_seqlens, [chunk._replace(v=chunk.v[:3])],
    )  # fmt: skip


@pytest.mark.parametrize("chunks", [None, 3, _chunk([2, 2])[0]])
def test_chunks_that_are_not_a_list_are_named(chunks) -> None:
    b = _new_tokens()
    expected = f"chunks must be a list of ContextChunk or (k, v, cu_seqlens_k, max_seqlen_k) tuples ([] for no context), got {type(chunks).__name__}"  # noqa: E501
    _refused(TypeError, "pack_chunks: " + expected, mla_ops.pack_chunks, b.k, b.v, b.cu_seqlens, chunks)
    _refused(
        TypeError, "prefill_with_context: " + expected,
        mla_ops.prefill_with_context, b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, chunks,
    )  # fmt: skip


def test_pack_chunks_keeps_accepting_what_is_valid() -> None:
    # Valid chunks, empty slices and no chunk at all pack as before: the same result as the chunks one by one.
    b = _new_tokens()
    chunks = [_chunk([2, 0], seed=1), _chunk([0, 3], seed=2)]
    packed = mla_ops.pack_chunks(b.k, b.v, b.cu_seqlens, chunks)
    want = mla_ops.prefill_with_context(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, chunks)
    got = mla_ops.prefill_with_context(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, [packed])
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[1], want[1], rtol=1e-3, atol=1e-3)
    empty = mla_ops.pack_chunks(b.k, b.v, b.cu_seqlens, [])
    assert empty.k.shape[0] == mla_ops.api.MIN_PACKED_ROWS and empty.cu_seqlens_k.tolist() == [0, 0, 0]


# --- pack_context: the latent form -------------------------------------------------------------------------------


def _layer() -> MLAAttention:
    return MLAAttention(MLAConfig(hidden_size=64, num_heads=2, kv_lora_rank=32, qk_rope_head_dim=16))


def _latent(rows: int, offsets, max_seqlen: int = 8) -> LatentChunk:
    return LatentChunk(torch.randn(rows, 32), torch.randn(rows, 16), offsets, max_seqlen)


@pytest.mark.parametrize(
    ("context", "error", "message"),
    [
        (
            None,
            TypeError,
            "pack_context: context must be a list of LatentChunk items ([] for no context), got NoneType",
        ),
        (
            [_latent(10, torch.tensor([0.6, 4.2, 10.0]))],
            TypeError,
            "pack_context: context[0].cu_seqlens_k must have dtype int32, got float32",
        ),
        (
            [_latent(10, cu_seqlens_of([4, 6])), _latent(10, torch.tensor([0, 8, 2], dtype=torch.int32))],
            ValueError,
            "pack_context: context[1]: cu_seqlens_k must be non-decreasing, got [0, 8, 2]",
        ),
        (
            [_latent(10, cu_seqlens_of([4, 6])[None])],
            ValueError,
            "pack_context: context[0].cu_seqlens_k must be a 1-D tensor of 3 entries",
        ),
        (
            [LatentChunk(torch.randn(10, 48), torch.randn(10, 16), cu_seqlens_of([4, 6]), 6)],
            ValueError,
            "pack_context: context[0]: kv_c must be [Tk, 32] for this layer, got shape (10, 48)",
        ),
        (
            [(torch.randn(10, 32), torch.randn(10, 16), cu_seqlens_of([4, 6]))],
            TypeError,
            "pack_context: context[0] must be a LatentChunk (kv_c, k_pe, cu_seqlens_k, max_seqlen_k), got 3 items",
        ),
    ],
)
def test_pack_context_names_the_chunk_at_fault(context, error, message) -> None:
    _refused(error, message, pack_context, _layer(), cu_seqlens_of([3, 4]), context)


# --- the raw ops: arguments torch parses before the ops' kernels run ----------------------------------------------


def test_raw_ops_name_a_none_tensor() -> None:
    b = _new_tokens()
    out, lse = mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, 4)
    _refused(
        TypeError, "mla.prefill: q must be a torch.Tensor [T, H, Dqk], got NoneType",
        torch.ops.mla.prefill, None, b.k, b.v, b.cu_seqlens, 4, 0.1,
    )  # fmt: skip
    _refused(
        TypeError, "mla.prefill_context_chunk: cu_seqlens_k must be an int32 torch.Tensor [B+1], got NoneType",
        torch.ops.mla.prefill_context_chunk, b.q, b.k, b.v, b.cu_seqlens, None, 4, 4, 0.1,
    )  # fmt: skip
    _refused(
        TypeError, "mla.merge_attn_states: prefix_out must be a torch.Tensor [T, H, Dv], got NoneType",
        torch.ops.mla.merge_attn_states, None, lse, out, lse,
    )  # fmt: skip


@pytest.mark.gpu
def test_raw_ops_name_a_none_tensor_on_cuda() -> None:
    # Where the native library loads, its C++ kernels see a CUDA call first: with a TRITON layout remembered (the
    # calls before), an undefined tensor must reach the Python check rather than fail in the C++ layout test.
    native.load()
    b = make_batch([3, 4], 2, 192, 128, BF16, device="cuda")
    with mla_ops.prefill_backend("TRITON"):
        for _ in range(2):
            out, lse = mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, 4)
            mla_ops.prefill_with_context(b.q, b.k, b.v, b.cu_seqlens, 4, [(b.k, b.v, b.cu_seqlens, 4)])
        _refused(
            TypeError, "mla.prefill: q must be a torch.Tensor [T, H, Dqk], got NoneType",
            torch.ops.mla.prefill, None, b.k, b.v, b.cu_seqlens, 4, 0.1,
        )  # fmt: skip
        _refused(
            TypeError, "mla.prefill_context_chunk: v must be a torch.Tensor [T, H, Dv], got NoneType",
            torch.ops.mla.prefill_with_chunk, b.q, b.k, b.v, b.cu_seqlens, 4, b.k, None, b.cu_seqlens, 4, 0.1,
        )  # fmt: skip
        _refused(
            TypeError, "mla.merge_attn_states: suffix_lse must be a float32 torch.Tensor [H, T], got NoneType",
            torch.ops.mla.merge_attn_states, out, lse, out, None,
        )  # fmt: skip


@pytest.mark.parametrize("value", [2**63, 2**80, -(2**63) - 1])
def test_raw_ops_name_an_int_beyond_int64(value) -> None:
    b = _new_tokens()
    message = "must be an int in [0, 2**31 - 1] (an upper bound of the longest sequence), got "
    _refused(
        ValueError, f"mla.prefill: max_seqlen {message}{value}",
        torch.ops.mla.prefill, b.q, b.k, b.v, b.cu_seqlens, value, 0.1,
    )  # fmt: skip
    _refused(
        ValueError, f"mla.prefill_context_chunk: max_seqlen_k {message}{value}",
        torch.ops.mla.prefill_context_chunk, b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens, 4, value, 0.1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(f"mla.prefill: max_seqlen {message}{value}")):
        torch.ops.mla.prefill(b.q, b.k, b.v, b.cu_seqlens, max_seqlen=value, softmax_scale=0.1)
    # Through the Python API the wrapper's own check answers first.
    _refused(ValueError, "mla.prefill: max_seqlen must be", mla_ops.prefill, b.q, b.k, b.v, b.cu_seqlens, value)


def test_raw_ops_keep_torchs_other_errors() -> None:
    b = _new_tokens()
    with pytest.raises(RuntimeError, match="Expected a value of type 'float' for argument 'softmax_scale'"):
        torch.ops.mla.prefill(b.q, b.k, b.v, b.cu_seqlens, 4, "0.1")


def test_max_seqlen_as_a_tensor() -> None:
    b = _new_tokens()
    _refused(TypeError, "mla.prefill: max_seqlen must be an int, got Tensor tensor(7.5000)",
             mla_ops.prefill, b.q, b.k, b.v, b.cu_seqlens, torch.tensor(7.5))  # fmt: skip
    # An integer tensor is an int (read on the host), and runs as that bound.
    out, lse = mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, torch.tensor(4))
    want_out, want_lse = mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, 4)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


# --- the backend override -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [3, 1.5, b"TRITON", ["TRITON"]])
def test_backend_override_of_another_type_is_named(name) -> None:
    choices = "('REFERENCE', 'TRITON', 'FLASH_ATTN', 'FLASHINFER'), a PrefillBackendEnum member or None"
    _refused(TypeError, f"set_prefill_backend: name must be a backend name {choices}, got {type(name).__name__}",
             mla_ops.set_prefill_backend, name)  # fmt: skip
    refused = pytest.raises(TypeError, match=re.escape(f"prefill_backend: name must be a backend name {choices}"))
    with refused, mla_ops.prefill_backend(name):
        pass
    assert mla_ops.selector.current_override() is None, "a refused name leaves the override as it was"


# --- MLAConfig --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_heads", 0, "MLAConfig: num_heads must be a positive int, got 0"),
        ("kv_lora_rank", -4, "MLAConfig: kv_lora_rank must be a positive int, got -4"),
        ("hidden_size", 10.5, "MLAConfig: hidden_size must be a positive int, got 10.5"),
        ("v_head_dim", True, "MLAConfig: v_head_dim must be a positive int, got True"),
        ("q_lora_rank", 0, "MLAConfig: q_lora_rank must be a positive int or None (queries from one q_proj), got 0"),
        ("qk_nope_head_dim", -1, "MLAConfig: qk_nope_head_dim must be an int >= 0, got -1"),
        ("qk_rope_head_dim", 63, "MLAConfig: qk_rope_head_dim must be even (the rotary embedding rotates"),
        ("rms_norm_eps", 0.0, "MLAConfig: rms_norm_eps must be a positive finite float, got 0.0"),
        ("rope_theta", float("inf"), "MLAConfig: rope_theta must be a positive finite float, got inf"),
    ],
)
def test_mla_config_validates_every_field(field, value, message) -> None:
    _refused(ValueError, message, MLAConfig, **{field: value})


def test_mla_config_accepts_the_models_it_describes() -> None:
    MLAConfig.deepseek_v3()
    MLAConfig(q_lora_rank=None, qk_nope_head_dim=0, qk_rope_head_dim=64)  # a rotary-only query is still a layer
    _refused(ValueError, "qk_nope_head_dim + qk_rope_head_dim must be positive", MLAConfig,
             qk_nope_head_dim=0, qk_rope_head_dim=0)  # fmt: skip


# --- settings: validated where they are read ---------------------------------------------------------------------


SETTING_CASES = [
    ("MLA_OPS_PREFILL_BACKEND", "BOGUS", "MLA_OPS_PREFILL_BACKEND='BOGUS': unknown MLA prefill backend 'BOGUS'"),
    ("MLA_OPS_TRITON_CONFIG", "garbage", "MLA_OPS_TRITON_CONFIG must be 'BLOCK_M,BLOCK_N,num_warps,num_stages"),
    ("MLA_OPS_NATIVE", "false", "MLA_OPS_NATIVE must be 0 (off) or 1 (on, the default), got 'false'"),
    ("MLA_OPS_FLASHINFER_WORKSPACE_MB", "abc", "MLA_OPS_FLASHINFER_WORKSPACE_MB must be a positive number of MiB"),
    ("MLA_OPS_NATIVE_MERGE", "false", "MLA_OPS_NATIVE_MERGE must be 0 (off) or 1 (on, the default), got 'false'"),
    ("MLA_OPS_NATIVE_LAUNCH", "off", "MLA_OPS_NATIVE_LAUNCH must be 0 (off) or 1 (on, the default), got 'off'"),
]


@pytest.mark.parametrize(("variable", "value", "message"), SETTING_CASES, ids=[c[0] for c in SETTING_CASES])
def test_each_setting_is_validated(monkeypatch: pytest.MonkeyPatch, variable, value, message) -> None:
    monkeypatch.setenv(variable, value)
    assert message in setting_problems()[variable]
    _refused(ValueError, message, check_settings)


def test_settings_are_validated_where_they_are_read(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from mla_ops.backends import flashinfer

    monkeypatch.setenv("MLA_OPS_FLASHINFER_WORKSPACE_MB", "abc")
    _refused(ValueError, "MLA_OPS_FLASHINFER_WORKSPACE_MB must be a positive number of MiB, got 'abc'",
             flashinfer.workspace_bytes_from_env)  # fmt: skip
    monkeypatch.setenv("MLA_OPS_TRITON_CONFIG", "garbage")
    _refused(ValueError, "MLA_OPS_TRITON_CONFIG must be", configs.attention_config,
             torch.device("cpu"), 192, 128, True, BF16)  # fmt: skip
    monkeypatch.setenv("MLA_OPS_NATIVE_MERGE", "no")
    _refused(ValueError, "MLA_OPS_NATIVE_MERGE must be 0 (off) or 1", native.unavailable_reason)
    monkeypatch.setenv("MLA_OPS_NATIVE_MERGE", "0")
    assert native.unavailable_reason() == "disabled by MLA_OPS_NATIVE_MERGE=0"
    monkeypatch.setenv("MLA_OPS_NATIVE_LAUNCH", "nope")
    _refused(ValueError, "MLA_OPS_NATIVE_LAUNCH must be 0 (off) or 1", native.launch_status)
    a_file = tmp_path / "file"
    a_file.write_text("")
    monkeypatch.setenv("MLA_OPS_CACHE_DIR", str(a_file))
    _refused(ValueError, f"MLA_OPS_CACHE_DIR={str(a_file)!r} is not a directory", native.cache_root)
    monkeypatch.setenv("MLA_OPS_CACHE_DIR", str(tmp_path / "new"))
    assert native.build_directory("k") == tmp_path / "new" / "native" / "k"


def test_valid_settings_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable, value in [
        ("MLA_OPS_PREFILL_BACKEND", "triton"),
        ("MLA_OPS_TRITON_CONFIG", "128,64,8,3"),
        ("MLA_OPS_NATIVE", "1"),
        ("MLA_OPS_FLASHINFER_WORKSPACE_MB", "256"),
        ("MLA_OPS_NATIVE_MERGE", "1"),
        ("MLA_OPS_NATIVE_LAUNCH", "0"),
    ]:
        monkeypatch.setenv(variable, value)
    assert setting_problems() == {}
    check_settings()


def test_every_setting_the_package_reads_is_listed() -> None:
    # Each MLA_OPS_* name in the package's sources is a setting that info shows and validates.
    from pathlib import Path

    from mla_ops.cli.info import SETTINGS

    root = Path(mla_ops.__file__).parent
    named = set()
    for path in [*root.rglob("*.py"), *root.rglob("*.cpp")]:
        named |= set(re.findall(r"\bMLA_OPS_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert named == set(SETTINGS), named ^ set(SETTINGS)
