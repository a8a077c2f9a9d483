"""The FLASH_ATTN adapter chain, on CPU, against stand-ins of the three FlashAttention implementations.

The stand-ins have the real functions' signatures (so an unknown keyword fails as it would on the real
library), check what the real kernels check (one head dim for FlashAttention-2, int32 offsets,
16-byte aligned rows), compute real attention with ``tests/utils.dense_attention``, and answer in each
library's own layout: ``+inf`` LSE for rows without keys and garbage past ``cu_seqlens[-1]``.
"""

from __future__ import annotations

import contextlib
import math
import sys
import types

import pytest
import torch
from utils import DEEPSEEK_DIMS, assert_attention_close, cu_seqlens_of, dense_attention, make_batch, make_qkv

import mla_ops
import mla_ops.backends.flash_attn as fa
from mla_ops import DeviceCapability, MLADimensions, SelectorConfig
from mla_ops.backends.flash_attn import FlashAttnBackend
from mla_ops.backends.registry import PrefillBackendEnum

DQK, DV = DEEPSEEK_DIMS
SM75, SM80, SM90 = DeviceCapability(7, 5), DeviceCapability(8, 0), DeviceCapability(9, 0)
BF16 = torch.bfloat16
NOTHING = (
    "none of flash_attn_interface, flash_attn, or a CUDA build of torch with FlashAttention is available; "
    "install flash-attn or a CUDA build of torch"
)


# --- stand-ins ----------------------------------------------------------------------------------------

_kernel_depth = 0


@contextlib.contextmanager
def _inside_kernel():
    """Host reads are allowed here: this code stands in for a CUDA kernel, which reads on the device."""
    global _kernel_depth
    _kernel_depth += 1
    try:
        yield
    finally:
        _kernel_depth -= 1


def _check_kernel_inputs(q, k, v, cu_q, cu_k, max_q, max_k):
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.dtype in (torch.float16, torch.bfloat16), f"{name}: FlashAttention only supports fp16 and bf16"
        assert t.stride(-1) == 1, f"{name} must have contiguous last dimension"
        assert t.data_ptr() % 16 == 0, f"{name}: misaligned base pointer"
        for n, s in zip(t.shape[:-1], t.stride()[:-1]):
            assert n == 1 or (s * t.element_size()) % 16 == 0, f"{name}: misaligned stride {t.stride()}"
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        assert cu.dtype == torch.int32 and cu.is_contiguous(), f"{name} must be contiguous int32"
    assert isinstance(max_q, int) and isinstance(max_k, int)
    with _inside_kernel():
        # The kernels size their grid from max_seqlen; a value below a real length would skip rows.
        assert max_q >= int((cu_q[1:] - cu_q[:-1]).max()), "max_seqlen_q is below a sequence length"
        assert max_k >= int((cu_k[1:] - cu_k[:-1]).max()), "max_seqlen_k is below a sequence length"


def _kernel(q, k, v, cu_q, cu_k, scale, causal, empty_lse):
    """Attention in the kernels' layout: out ``[Tq, H, v.shape[-1]]``, lse float32 ``[H, Tq]``."""
    with _inside_kernel():
        out, lse = dense_attention(q, k, v, cu_q, cu_k, scale, causal, torch.float32)
        valid = int(cu_q[-1])
    out, lse = out.to(q.dtype), lse.float()
    lse[torch.isneginf(lse)] = empty_lse
    out[valid:] = math.nan  # rows past cu_seqlens[-1] are never written by the kernels
    lse[:, valid:] = 1e30
    return out, lse


def _fa2_module(calls: list[dict]) -> types.ModuleType:
    """``flash_attn`` 2.x: one head dim for q, k, v; ``return_attn_probs`` gives (out, lse, S_dmask)."""

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
        causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
        return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        calls.append(dict(
            q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, return_attn_probs=return_attn_probs,
        ))  # fmt: skip
        if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
            raise RuntimeError("v must have shape (total_k, num_heads_k, head_size_og)")
        _check_kernel_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        out, lse = _kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, math.inf)
        return (out, lse, torch.empty(0, dtype=q.dtype)) if return_attn_probs else out

    module = types.ModuleType("flash_attn")
    module.__version__ = "2.8.3"
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


def _fa3_module(calls: list[dict], variant: str) -> types.ModuleType:
    """``flash_attn_interface`` (hopper/) in three generations of its return convention.

    ``old``: no flag, always ``(out, lse)`` (late 2024); ``new``: ``return_attn_probs`` (2025 main);
    ``lse_flag``: ``return_softmax_lse`` (forks); ``no_lse``: a function that never returns the LSE.
    """

    def run(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, flag):
        calls.append(dict(
            q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            softmax_scale=softmax_scale, causal=causal, flag=flag,
        ))  # fmt: skip
        _check_kernel_inputs(q, k, v, cu_q, cu_k, max_q, max_k)
        # store_zero writes -inf; the softmax epilogue writes +inf: both mean "no keys".
        return _kernel(q, k, v, cu_q, cu_k, softmax_scale, causal, -math.inf if variant == "old" else math.inf)

    if variant == "old":

        def flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
            q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1), softcap=0.0, num_splits=1,
            pack_gqa=None, deterministic=False,
        ):  # fmt: skip
            return run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, None)

    elif variant == "new":

        def flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
            softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
            window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
            deterministic=False, sm_margin=0, return_attn_probs=False,
        ):  # fmt: skip
            flag = ("return_attn_probs", return_attn_probs)
            args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, flag)
            out, lse = run(*args)
            return (out, lse) if return_attn_probs else out

    elif variant == "lse_flag":

        def flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None, softmax_scale=None,
            causal=False, window_size=(-1, -1), softcap=0.0, return_softmax_lse=False, out=None,
        ):  # fmt: skip
            flag = ("return_softmax_lse", return_softmax_lse)
            args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, flag)
            result = run(*args)
            return result if return_softmax_lse else result[0]

    else:  # "no_lse"

        def flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False
        ):
            return run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, None)[0]

    module = types.ModuleType("flash_attn_interface")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


def _bundled_op(calls: list[dict]):
    """``torch.ops.aten._flash_attention_forward`` as the schema declares it (torch 2.13)."""

    def _flash_attention_forward(
        query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
        scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
        block_table=None, num_splits=None,
    ):  # fmt: skip
        calls.append(dict(
            q=query, k=key, v=value, cu_seqlens_q=cum_seq_q, cu_seqlens_k=cum_seq_k, max_seqlen_q=max_q,
            max_seqlen_k=max_k, dropout_p=dropout_p, causal=is_causal, return_debug_mask=return_debug_mask,
            softmax_scale=scale, window_size_left=window_size_left,
        ))  # fmt: skip
        if not (query.shape[-1] == key.shape[-1] == value.shape[-1]):
            raise RuntimeError("value must have shape (total_k, num_heads_k, head_size_og)")
        _check_kernel_inputs(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
        out, lse = _kernel(query, key, value, cum_seq_q, cum_seq_k, scale, is_causal, math.inf)
        rng_state = torch.empty(2, dtype=torch.int64)
        return out, lse, rng_state, torch.empty(()), torch.empty(0, dtype=query.dtype)

    return _flash_attention_forward


class Chain:
    """Installs stand-ins (or their absence) and records every kernel call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.calls: list[dict] = []

    def install(self, fa3: str | None = None, fa2: bool = False, bundled: bool = False) -> Chain:
        mp = self.monkeypatch
        mp.setitem(sys.modules, "flash_attn_interface", _fa3_module(self.calls, fa3) if fa3 else None)
        mp.setitem(sys.modules, "flash_attn", _fa2_module(self.calls) if fa2 else None)
        if bundled:
            op = _bundled_op(self.calls)
            mp.setattr(fa, "_bundled_forward_op", lambda: op)
        else:

            def absent():
                raise RuntimeError("torch 2.13.0+cpu is not a CUDA build")

            mp.setattr(fa, "_bundled_forward_op", absent)
        fa.reset_implementation_cache()
        return self


@pytest.fixture
def chain(monkeypatch: pytest.MonkeyPatch):
    fa.reset_implementation_cache()
    yield Chain(monkeypatch)
    fa.reset_implementation_cache()


@pytest.fixture
def no_host_sync(monkeypatch: pytest.MonkeyPatch):
    """A context manager in which every host read of a tensor fails, except inside the stand-in kernels."""

    @contextlib.contextmanager
    def guard():
        with monkeypatch.context() as mp:
            for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
                original = getattr(torch.Tensor, name)

                def guarded(self, *args, _name=name, _original=original, **kwargs):
                    if _kernel_depth == 0:
                        raise AssertionError(f"host sync: Tensor.{_name} called outside a kernel")
                    return _original(self, *args, **kwargs)

                mp.setattr(torch.Tensor, name, guarded)
            yield

    return guard


def _run(path: str, q, k, v, cu_q, cu_k, max_q, max_k, scale):
    if path == "prefill":
        return FlashAttnBackend.prefill(q, k, v, cu_q, max_q, scale)
    return FlashAttnBackend.prefill_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, scale)


# --- availability and selection of the implementation -------------------------------------------------


def test_registry_points_at_the_backend():
    assert PrefillBackendEnum.FLASH_ATTN.get_class() is FlashAttnBackend
    assert FlashAttnBackend.name == "FLASH_ATTN"


def test_nothing_present_means_unavailable(chain):
    chain.install()
    assert FlashAttnBackend.unavailable_reason() == NOTHING
    assert not FlashAttnBackend.is_available()
    assert FlashAttnBackend.validate_configuration(SM90, SelectorConfig(BF16)) == [NOTHING]
    text = FlashAttnBackend.implementation(SM90)
    assert text.startswith("none usable")
    assert "flash_attn_interface: not available" in text and "not a CUDA build" in text


@pytest.mark.skipif(
    torch.version.cuda is not None, reason="this torch is a CUDA build, so its bundled FlashAttention is present"
)
def test_ci_machine_has_no_implementation(chain, monkeypatch):
    # The real probe of torch (a CPU build here), with both packages absent whatever is installed.
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    fa.reset_implementation_cache()
    assert FlashAttnBackend.unavailable_reason() == NOTHING
    with mla_ops.prefill_backend("FLASH_ATTN"), pytest.raises(ValueError, match="none of flash_attn_interface"):
        mla_ops.select_backend(SM90, SelectorConfig(BF16))


def test_probe_failures_never_raise(chain, monkeypatch):
    chain.install(fa2=True)

    def broken_fa3():
        raise OSError("libcudart.so.12: cannot open shared object file")

    monkeypatch.setattr(fa, "_load_fa3", broken_fa3)
    fa.reset_implementation_cache()
    assert FlashAttnBackend.unavailable_reason() is None
    assert "OSError: libcudart.so.12" in FlashAttnBackend.implementation(SM90)

    def broken_chain():
        raise RuntimeError("boom")

    broken_chain.cache_clear = lambda: None
    fa.reset_implementation_cache()  # so that the real cache holds no stand-in once the patch is undone
    monkeypatch.setattr(fa, "_chain", broken_chain)
    assert FlashAttnBackend.unavailable_reason() == "probing FlashAttention failed: RuntimeError('boom')"
    assert not FlashAttnBackend.is_available()
    assert FlashAttnBackend.implementation(SM90).startswith("unknown (probing FlashAttention failed")
    assert FlashAttnBackend.validate_configuration(SM90, SelectorConfig(BF16))  # reasons, not an exception


@pytest.mark.parametrize(
    ("present", "capability", "expected"),
    [
        (dict(fa3="new", fa2=True, bundled=True), SM90, fa._FA3),
        (dict(fa3="new", fa2=True, bundled=True), SM80, fa._FA2),
        (dict(fa3="new", bundled=True), SM80, fa._BUNDLED),
        (dict(fa2=True, bundled=True), SM90, fa._FA2),
        (dict(bundled=True), SM90, fa._BUNDLED),
        (dict(fa3="old", fa2=True), None, fa._FA3),  # a CPU tensor: no capability to filter by
    ],
)
def test_chain_picks_the_first_usable(chain, present, capability, expected):
    chain.install(**present)
    adapter, skipped = fa._choose(capability, DQK, DV)
    assert adapter is not None and adapter.kind is expected
    text = FlashAttnBackend.implementation(capability or SM90)
    if capability is not None:
        assert text.startswith(expected.label)
    if expected is not fa._FA3:
        assert skipped[0].startswith("flash_attn_interface: ")
        assert "skipped: flash_attn_interface: " in text


def test_chain_routes_unsupported_dims_past_fa3(chain):
    chain.install(fa3="new", fa2=True)
    # Dv=64 with Dqk=192 is outside FlashAttention-3's Dv != Dqk combinations, so FlashAttention-2 runs it.
    adapter, skipped = fa._choose(SM90, 192, 64)
    assert adapter.kind is fa._FA2
    assert skipped == [
        "flash_attn_interface: FlashAttention-3 (flash_attn_interface) supports Dv != Dqk only for Dqk in "
        "(128, 192] with Dv in (96, 128], or Dqk <= 64 with Dv <= 512"
    ]
    assert FlashAttnBackend.implementation(SM90, MLADimensions(128, 64, 64)).startswith("FlashAttention-2 (flash_attn)")
    assert "FlashAttention-3" in FlashAttnBackend.implementation(SM90)  # DeepSeek's dims stay on FA3


# --- validation -----------------------------------------------------------------------------------------

FA3_LABEL = "FlashAttention-3 (flash_attn_interface)"
FA2_LABEL = "FlashAttention-2 (flash_attn)"
BUNDLED_LABEL = "PyTorch's bundled FlashAttention-2 (torch.ops.aten._flash_attention_forward)"
FA3_NOT_90 = f"{FA3_LABEL} needs compute capability 9.0 (Hopper), got {{}}"
FA3_DV_RULE = (
    f"{FA3_LABEL} supports Dv != Dqk only for Dqk in (128, 192] with Dv in (96, 128], or Dqk <= 64 with Dv <= 512"
)
FA2_ABSENT = "flash_attn: not available (ModuleNotFoundError: import of flash_attn halted; None in sys.modules)"
FA3_ABSENT = (
    "flash_attn_interface: not available "
    "(ModuleNotFoundError: import of flash_attn_interface halted; None in sys.modules)"
)
BUNDLED_ABSENT = (
    "torch.ops.aten._flash_attention_forward: not available (RuntimeError: torch 2.13.0+cpu is not a CUDA build)"
)


def _not_installed(capability, dqk, dv, *why):
    return (
        f"no installed FlashAttention implementation serves compute capability {capability} with head dims "
        f"(Dqk={dqk}, Dv={dv}): " + "; ".join(why)
    )


@pytest.mark.parametrize(
    ("present", "capability", "dims", "dtype", "expected"),
    [
        # The chain covers these; what is installed decides.
        (dict(fa3="new"), SM80, (128, 64, 128), BF16, [
            _not_installed(SM80, 192, 128, "flash_attn_interface: " + FA3_NOT_90.format(SM80), FA2_ABSENT,
                           BUNDLED_ABSENT)
        ]),
        (dict(fa3="new", bundled=True), SM80, (128, 64, 128), BF16, []),
        (dict(fa2=True), DeviceCapability(10, 0), (128, 64, 128), BF16, []),
        (dict(fa3="new"), SM90, (128, 64, 64), BF16, [
            _not_installed(SM90, 192, 64, "flash_attn_interface: " + FA3_DV_RULE, FA2_ABSENT, BUNDLED_ABSENT)
        ]),
        (dict(bundled=True), SM90, (64, 0, 288), BF16, [
            _not_installed(SM90, 64, 288, FA3_ABSENT, FA2_ABSENT, "torch.ops.aten._flash_attention_forward: "
                           f"{BUNDLED_LABEL} supports head dims up to 256, and the padded head dim max(Dqk, Dv) is 288")
        ]),
        (dict(fa3="new"), SM90, (64, 0, 288), BF16, []),  # FA3's (Dqk <= 64, Dv <= 512) family
        (dict(fa3="new", fa2=True), SM90, (128, 64, 64), BF16, []),  # FA2 serves what FA3 does not
        (dict(fa3="new", fa2=True), SM90, (192, 64, 256), BF16, []),  # the wide-head configuration
        # The chain does not cover these, whatever is installed.
        (dict(fa2=True), SM75, (128, 64, 128), BF16, [
            f"compute capability 7.5 is not supported: {FA3_NOT_90.format(SM75)}; "
            f"{FA2_LABEL} needs compute capability 8.0 or newer, got 7.5; "
            f"{BUNDLED_LABEL} needs compute capability 8.0 or newer, got 7.5"
        ]),
        (dict(fa2=True), SM90, (256, 64, 128), BF16, [
            f"head dims (Dqk=320, Dv=128) are not supported: {FA3_LABEL} supports Dqk up to 256; "
            f"{FA2_LABEL} supports head dims up to 256, and the padded head dim max(Dqk, Dv) is 320; "
            f"{BUNDLED_LABEL} supports head dims up to 256, and the padded head dim max(Dqk, Dv) is 320"
        ]),
        (dict(bundled=True), SM80, (128, 60, 128), BF16, [  # FA3 does not run on 8.0, so only FA2 rules count
            f"head dims (Dqk=188, Dv=128) are not supported: "
            f"{FA2_LABEL} needs the padded head dim max(Dqk, Dv) = 188 to be a multiple of 8; "
            f"{BUNDLED_LABEL} needs the padded head dim max(Dqk, Dv) = 188 to be a multiple of 8"
        ]),
        (dict(fa2=True), SM90, (128, 64, 128), torch.float32, [
            "dtype float32 is not supported (use bfloat16, float16)"
        ]),
        (dict(fa2=True), None, (128, 64, 128), BF16, ["runs on CUDA devices only, not on CPU"]),
        (dict(), SM90, (128, 64, 128), BF16, [NOTHING]),
        (dict(), SM75, (128, 64, 128), BF16, [
            NOTHING,
            f"compute capability 7.5 is not supported: {FA3_NOT_90.format(SM75)}; "
            f"{FA2_LABEL} needs compute capability 8.0 or newer, got 7.5; "
            f"{BUNDLED_LABEL} needs compute capability 8.0 or newer, got 7.5",
        ]),
    ],
)  # fmt: skip
def test_validation_reasons(chain, present, capability, dims, dtype, expected):
    chain.install(**present)
    config = SelectorConfig(dtype, MLADimensions(*dims))
    assert FlashAttnBackend.validate_configuration(capability, config) == expected


@pytest.mark.parametrize("capability", [SM75, SM80, SM90, DeviceCapability(10, 0), None])
@pytest.mark.parametrize("dims", [(128, 64, 128), (128, 64, 64), (64, 0, 288), (256, 64, 128), (192, 64, 256)])
def test_selection_rules_ignore_what_is_installed(chain, capability, dims):
    config = SelectorConfig(BF16, MLADimensions(*dims))
    seen = []
    for present in (dict(), dict(fa3="new"), dict(fa2=True, bundled=True)):
        chain.install(**present)
        seen.append(FlashAttnBackend.configuration_reasons(capability, config))
    assert seen[0] == seen[1] == seen[2]


def test_invalid_override_names_the_reason(chain):
    chain.install(fa3="new")
    config = SelectorConfig(BF16)
    with mla_ops.prefill_backend("FLASH_ATTN"), pytest.raises(ValueError) as info:
        mla_ops.select_backend(SM80, config)
    assert str(info.value).startswith("Selected MLA prefill backend FLASH_ATTN is not valid for this configuration.")
    assert "needs compute capability 9.0 (Hopper), got 8.0" in str(info.value)


# --- calls and results, per implementation -----------------------------------------------------------------

RAGGED = [0, 5, 17, 0, 33, 1]  # includes zero-length sequences
CHUNK = [4, 0, 21, 3, 0, 9]  # per-sequence slices of a context chunk; seq 1 and 4 have none


def _chunk_inputs(num_heads, strided_v, seed=1, dv=DV, dqk=DQK, dtype=BF16):
    batch = make_batch(RAGGED, num_heads, dqk, dv, dtype, strided_v=strided_v, padding=3, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    _, k, v = make_qkv(sum(CHUNK) + 2, num_heads, dqk, dv, dtype, strided_v=strided_v, generator=gen)
    return batch, k, v, cu_seqlens_of(CHUNK)


@pytest.mark.parametrize("path", ["prefill", "chunk"])
@pytest.mark.parametrize("impl", ["fa2", "bundled"])
def test_padded_implementations(chain, no_host_sync, impl, path):
    chain.install(fa2=impl == "fa2", bundled=impl == "bundled")
    batch, kc, vc, cu_k = _chunk_inputs(4, strided_v=True)
    scale = 0.0721
    if path == "prefill":
        k, v, cu_k, max_q, max_k = batch.k, batch.v, batch.cu_seqlens, 64, 64  # an upper bound, passed as is
    else:
        k, v, max_q, max_k = kc, vc, 40, 30
    with no_host_sync():
        out, lse = _run(path, batch.q, k, v, batch.cu_seqlens, cu_k, max_q, max_k, scale)

    (call,) = chain.calls
    assert call["q"] is batch.q and call["k"] is k
    assert call["cu_seqlens_q"] is batch.cu_seqlens and call["cu_seqlens_k"] is cu_k
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (max_q, max_k)
    assert call["softmax_scale"] == scale and call["causal"] is (path == "prefill")
    assert call["dropout_p"] == 0.0
    if impl == "fa2":
        assert call["return_attn_probs"] is True and call["window_size"] == (-1, -1)
    else:
        assert call["return_debug_mask"] is False and call["window_size_left"] is None
    # v reached the kernel Dqk wide, as a window over its own storage: the last Dv columns are v.
    wide = call["v"]
    assert wide.shape == (v.shape[0], 4, DQK)
    assert wide.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert torch.equal(wide[..., DQK - DV :], v)

    assert out.shape == (batch.q.shape[0], 4, DV) and out.is_contiguous() and out.dtype == BF16
    assert lse.shape == (4, batch.q.shape[0]) and lse.is_contiguous() and lse.dtype == torch.float32
    causal = path == "prefill"
    assert_attention_close(out, lse, batch.q, k, v, batch.cu_seqlens, cu_k, scale, causal)
    assert not torch.isposinf(lse).any(), "+inf must become -inf"


@pytest.mark.parametrize("variant", ["old", "new", "lse_flag"])
@pytest.mark.parametrize("path", ["prefill", "chunk"])
def test_fa3_native_dv_and_return_conventions(chain, no_host_sync, variant, path):
    chain.install(fa3=variant, fa2=True, bundled=True)
    batch, kc, vc, cu_k = _chunk_inputs(3, strided_v=False)
    scale = 0.11
    if path == "prefill":
        k, v, cu_k, max_q, max_k = batch.k, batch.v, batch.cu_seqlens, 33, 33
    else:
        k, v, max_q, max_k = kc, vc, 33, 21
    with no_host_sync():
        out, lse = _run(path, batch.q, k, v, batch.cu_seqlens, cu_k, max_q, max_k, scale)

    (call,) = chain.calls  # FlashAttention-3 ran, and nothing else
    assert call["v"] is v, "FlashAttention-3 takes Dv != Dqk natively: v must not be padded or copied"
    expected_flag = {"old": None, "new": ("return_attn_probs", True), "lse_flag": ("return_softmax_lse", True)}
    assert call["flag"] == expected_flag[variant]
    assert (call["max_seqlen_q"], call["max_seqlen_k"], call["softmax_scale"]) == (max_q, max_k, scale)
    assert call["causal"] is (path == "prefill")
    assert out.is_contiguous() and lse.is_contiguous()
    assert_attention_close(out, lse, batch.q, k, v, batch.cu_seqlens, cu_k, scale, path == "prefill")


def test_fa3_without_lse_is_a_clear_error(chain):
    chain.install(fa3="no_lse")
    batch = make_batch([5, 3], 2, DQK, DV, BF16)
    with pytest.raises(RuntimeError, match="returned only the output, not the softmax LSE"):
        FlashAttnBackend.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, 5, 0.1)


def test_old_padded_lse_layout_is_rejected(chain, monkeypatch):
    chain.install(fa2=True)
    module = sys.modules["flash_attn"]
    real = module.flash_attn_varlen_func

    def padded_lse(*args, **kwargs):
        out, lse, s = real(*args, **kwargs)
        return out, lse.new_zeros((2, lse.shape[0], 5)), s  # flash-attn < 2.5: [B, H, max_seqlen_q]

    monkeypatch.setattr(module, "flash_attn_varlen_func", padded_lse)
    fa.reset_implementation_cache()
    batch = make_batch([5, 3], 2, DQK, DV, BF16)
    with pytest.raises(RuntimeError, match=r"varlen layout float32 \[H, total_q\] = \[2, 8\]"):
        FlashAttnBackend.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, 5, 0.1)


def test_dv_wider_than_dqk_pads_q_and_k(chain, no_host_sync):
    chain.install(bundled=True)
    batch = make_batch(RAGGED, 2, 64, 128, torch.float16, seed=3)
    with no_host_sync():
        out, lse = FlashAttnBackend.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, 33, 0.125)
    (call,) = chain.calls
    assert call["q"].shape[-1] == call["k"].shape[-1] == 128 and call["v"] is batch.v
    assert torch.equal(call["q"][..., :64], batch.q) and not call["q"][..., 64:].any()
    assert out.dtype == torch.float16
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 0.125, True)


def test_equal_head_dims_are_not_padded(chain):
    chain.install(fa2=True)
    batch = make_batch([7, 2], 2, 128, 128, BF16)
    out, lse = FlashAttnBackend.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, 7, 0.1)
    assert chain.calls[0]["v"] is batch.v
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 0.1, True)


def test_misaligned_q_is_copied_before_the_kernel(chain):
    chain.install(fa2=True)
    batch = make_batch([9, 4], 2, DQK, DV, BF16)
    storage = torch.zeros(batch.q.shape[0], 2, DQK + 8, dtype=BF16)
    q = storage[..., 4 : 4 + DQK]  # starts 8 bytes into a 16-byte boundary
    q.copy_(batch.q)
    out, lse = FlashAttnBackend.prefill(q, batch.k, batch.v, batch.cu_seqlens, 9, 0.1)
    assert chain.calls[0]["q"] is not q and chain.calls[0]["q"].is_contiguous()
    assert_attention_close(out, lse, q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 0.1, True)


@pytest.mark.parametrize("case", ["no_tokens", "no_sequences", "no_keys", "max_seqlen_q_0", "max_seqlen_k_0"])
def test_degenerate_shapes_skip_the_kernel(chain, no_host_sync, case):
    chain.install(fa2=True)
    tokens = 0 if case == "no_tokens" else 6
    q, k, v = make_qkv(tokens, 2, DQK, DV, BF16)
    length = 0 if case == "max_seqlen_q_0" else tokens
    cu_q = torch.zeros(1, dtype=torch.int32) if case == "no_sequences" else torch.tensor([0, length], dtype=torch.int32)
    cu_k = torch.zeros_like(cu_q)
    if case == "no_keys":
        k, v = k[:0], v[:0]
    max_q, max_k = length, 0 if case == "max_seqlen_k_0" else tokens
    with no_host_sync():
        out, lse = FlashAttnBackend.prefill_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, 0.1)
    assert chain.calls == []
    assert out.shape == (tokens, 2, DV) and lse.shape == (2, tokens)
    assert not out.any() and torch.isneginf(lse).all()


# --- widening v ------------------------------------------------------------------------------------------


def _views(kind: str, tokens: int = 11, heads: int = 3):
    """``(v, extra)``: a ``[tokens, heads, 128]`` v and the storage columns a window would add to it."""
    if kind == "window-before":  # v = kv_nope[..., 128:] of [T, H, 256]: k_nope's last 64 columns precede it
        kv = torch.randn(tokens, heads, 256).to(BF16)
        return kv[..., 128:], kv[..., 64:128]
    if kind == "window-after":  # v = kv[..., :128] of [T, H, 256]: 64 readable columns follow each row
        kv = torch.randn(tokens, heads, 256).to(BF16)
        return kv[..., :128], kv[..., 128:192]
    if kind == "copy-contiguous":
        return torch.randn(tokens, heads, 128).to(BF16), None
    if kind == "copy-strided":  # only 16 columns before a row, and nothing after the last one
        kv = torch.randn(tokens, heads, 144).to(BF16)
        return kv[..., 16:], None
    if kind == "copy-misaligned":  # room before, but the window would start 8 bytes off a 16-byte boundary
        kv = torch.randn(tokens, heads, 200).to(BF16)
        return kv[..., 68:196], None
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["window-before", "window-after", "copy-contiguous", "copy-strided", "copy-misaligned"]
)
def test_widen_v(kind):
    v, extra = _views(kind)
    wide, first, how = fa.widen_v(v, DQK)
    assert how == ("copy" if kind.startswith("copy") else kind)
    assert wide.shape == (*v.shape[:2], DQK) and wide.stride(-1) == 1
    assert torch.equal(wide[..., first : first + DV], v)
    if how == "copy":
        assert wide.is_contiguous() and first == 0 and not wide[..., DV:].any(), "the copy is zero-padded"
    else:
        assert wide.untyped_storage().data_ptr() == v.untyped_storage().data_ptr(), "a window must not copy"
        assert wide.stride() == v.stride()
        extra_cols = wide[..., :first] if first else wide[..., DV:]
        assert torch.equal(extra_cols, extra)


def test_widen_v_leaves_full_width_alone():
    v = torch.randn(4, 2, DQK).to(BF16)
    assert fa.widen_v(v, DQK) == (v, 0, "none")


@pytest.mark.parametrize("kind", ["window-before", "window-after", "copy-strided"])
@pytest.mark.parametrize("impl", ["fa2", "bundled"])
def test_nan_in_window_columns_does_not_leak(chain, impl, kind):
    chain.install(fa2=impl == "fa2", bundled=impl == "bundled")
    lengths = [4, 0, 7]
    v, extra = _views(kind, tokens=sum(lengths))
    if extra is not None:
        extra.fill_(math.nan)  # the window's extra columns: they may hold anything
    gen = torch.Generator().manual_seed(7)
    q, k, _ = make_qkv(sum(lengths), 3, DQK, DV, BF16, generator=gen)
    cu = cu_seqlens_of(lengths)
    out, lse = FlashAttnBackend.prefill(q, k, v, cu, 7, 0.09)
    (call,) = chain.calls
    if extra is not None:
        assert torch.isnan(call["v"]).any(), "the kernel saw the NaN columns"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_attention_close(out, lse, q, k, v, cu, cu, 0.09, True)


@pytest.mark.parametrize("offset", [0, 2, 16])
def test_padding_and_slicing_copies_are_exact(offset):
    # Offsets 0 and 16 take the 8-byte-word copies, offset 2 the element-wise ones.
    kv = torch.randn(64, 8, 160).to(BF16)  # large enough for the word copies
    v = kv[..., offset : offset + DV]
    assert (fa._as_words(v) is None) == (offset % 4 != 0)
    padded = fa._pad_columns(v, DQK)
    assert padded.is_contiguous() and torch.equal(padded, torch.nn.functional.pad(v, (0, DQK - DV)))
    wide = torch.randn(64, 8, DQK).to(BF16)
    for first in (0, 2, DQK - DV):
        got = fa._columns(wide, first, DV)
        assert got.is_contiguous() and torch.equal(got, wide[..., first : first + DV])
