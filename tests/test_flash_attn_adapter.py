"""FLASH_ATTN-specific behaviour on CPU: the chain of FlashAttention implementations, each adapter's calls,
widening ``v``, and FlashAttention-4's just-in-time compiles under CUDA-graph capture.

The backend is built around the stand-ins of tests/standins.py, injected by name
(``FlashAttnBackend(libraries=...)``); absent names are absent. Correctness on both paths for each
implementation is in tests/test_backend_contract.py; here the calls themselves are checked (what reaches
the kernel, with what flags, copied or not), under a guard that fails on any host sync outside a
stand-in kernel.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass

import pytest
import standins
import torch
from standins import no_host_sync
from torch.utils._python_dispatch import TorchDispatchMode
from utils import DEEPSEEK_DIMS, RaggedBatch, assert_attention_close, cu_seqlens_of, make_batch, make_qkv

import mla_ops
import mla_ops.backends.flash_attn as fa
from mla_ops import DeviceCapability, MLADimensions, SelectorConfig
from mla_ops.backends.base import VarlenCall
from mla_ops.backends.flash_attn import FlashAttnBackend
from mla_ops.backends.registry import PrefillBackendEnum
from mla_ops.selector import backend_installed

DQK, DV = DEEPSEEK_DIMS
SM75, SM80, SM90, SM100 = (DeviceCapability(*c) for c in ((7, 5), (8, 0), (9, 0), (10, 0)))
BF16 = torch.bfloat16
FA4, FA3, FA2, BUNDLED = standins.FLASH_ATTN_NAMES
NOTHING = (
    "none of flash_attn.cute, flash_attn_interface, flash_attn, or a CUDA build of torch with FlashAttention is "
    "available; install flash-attn-4 (pip install 'mla_ops[flash-attn]'), flash-attn, or a CUDA build of torch"
)

FA4_LABEL = "FlashAttention-4 (flash_attn.cute)"
FA3_LABEL = "FlashAttention-3 (flash_attn_interface)"
FA2_LABEL = "FlashAttention-2 (flash_attn)"
BUNDLED_LABEL = "PyTorch's bundled FlashAttention-2 (torch.ops.aten._flash_attention_forward)"
FA4_NOT_USED = f"{FA4_LABEL} is used on compute capability 9.x, 10.x and 11.x, got {{}}"
FA3_NOT_90 = f"{FA3_LABEL} needs compute capability 9.0 (Hopper), got {{}}"
FA3_DV_RULE = (
    f"{FA3_LABEL} supports Dv != Dqk only for Dqk in (128, 192] with Dv in (96, 128], or Dqk <= 64 with Dv <= 512"
)
SM75_RULE = (
    f"compute capability 7.5 is not supported: {FA4_NOT_USED.format(SM75)}; {FA3_NOT_90.format(SM75)}; "
    f"{FA2_LABEL} needs compute capability 8.0 or newer, got 7.5; "
    f"{BUNDLED_LABEL} needs compute capability 8.0 or newer, got 7.5"
)


class Chain:
    """A FLASH_ATTN backend around stand-ins of the named implementations, and what they recorded."""

    def __init__(self, *names: str, fa3: str = "new") -> None:
        self.libraries = standins.flash_attn_libraries(*names, fa3=fa3)
        self.backend = FlashAttnBackend(libraries=self.libraries)

    @property
    def calls(self) -> list[dict]:
        """Every kernel call, in the chain's order of implementations."""
        return [call for library in self.libraries.values() for call in library.calls]

    def run(self, path: str, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        if path == "prefill":
            return self.backend.attention(VarlenCall(q, k, v, cu_q, cu_q, max_q, max_q, scale, True))
        return self.backend.attention(VarlenCall(q, k, v, cu_q, cu_k, max_q, max_k, scale, False))


# --- the chain -------------------------------------------------------------------------------------------


def test_registry_points_at_the_backend():
    assert PrefillBackendEnum.FLASH_ATTN.backend_class() is FlashAttnBackend
    assert isinstance(PrefillBackendEnum.FLASH_ATTN.backend(), FlashAttnBackend)
    assert FlashAttnBackend.name == "FLASH_ATTN"


def test_nothing_present_means_unavailable():
    backend = Chain().backend
    assert backend.library_reasons(SM90, SelectorConfig(BF16)) == [NOTHING]
    assert backend.reasons(SM90, SelectorConfig(BF16)) == [NOTHING]
    text = backend.describe(SM90, SelectorConfig(BF16))
    assert text.startswith("none usable [skipped: flash_attn.cute: not available (ImportError: flash_attn.cute is")
    assert "flash_attn_interface: not available" in text


@pytest.mark.skipif(
    torch.version.cuda is not None, reason="this torch is a CUDA build, so its bundled FlashAttention is present"
)
def test_ci_machine_has_no_implementation(monkeypatch):
    # The real probes (this torch is a CPU build), with the packages absent whatever is installed.
    for name in ("flash_attn", "flash_attn.cute", "flash_attn_interface"):
        monkeypatch.setitem(sys.modules, name, None)
    backend = FlashAttnBackend()
    assert backend.library_reasons(SM90, SelectorConfig(BF16)) == [NOTHING]
    assert backend.chain().absent[BUNDLED] == f"RuntimeError: torch {torch.__version__} is not a CUDA build"
    with (
        backend_installed(backend),
        mla_ops.prefill_backend("FLASH_ATTN"),
        pytest.raises(ValueError, match=r"none of flash_attn\.cute, flash_attn_interface"),
    ):
        mla_ops.select_backend(SM90, SelectorConfig(BF16))


class _BrokenLibrary:
    """A library whose import succeeded but whose kernels cannot load (a missing CUDA library, say)."""

    def __getattr__(self, name):
        raise OSError("libcudart.so.12: cannot open shared object file")


def test_a_broken_library_is_absent_and_says_why():
    backend = FlashAttnBackend(libraries={FA3: _BrokenLibrary(), FA2: standins.fa2_module()})
    assert backend.reasons(SM90, SelectorConfig(BF16)) == []
    assert backend.chain().absent[FA3] == "OSError: libcudart.so.12: cannot open shared object file"
    assert "flash_attn_interface: not available (OSError: libcudart.so.12" in backend.describe(
        SM90, SelectorConfig(BF16)
    )


def test_a_failing_probe_reports_instead_of_raising():
    class Failing(FlashAttnBackend):
        def chain(self):
            raise RuntimeError("boom")

    backend = Failing()
    assert backend.reasons(SM90, SelectorConfig(BF16)) == ["availability check failed: RuntimeError: boom"]
    assert (
        backend.describe(SM90, SelectorConfig(BF16)) == "unknown (probing FlashAttention failed: RuntimeError('boom'))"
    )


ALL = (FA4, FA3, FA2, BUNDLED)


@pytest.mark.parametrize(
    ("present", "capability", "expected", "skipped"),
    [
        (ALL, SM90, FA4, []),
        (ALL, SM100, FA4, []),
        (ALL, DeviceCapability(11, 0), FA4, []),
        (ALL, SM80, FA2, [FA4, FA3]),
        ((FA3, FA2, BUNDLED), SM90, FA3, [FA4]),
        ((FA3, BUNDLED), SM80, BUNDLED, [FA4, FA3, FA2]),
        ((FA2, BUNDLED), SM90, FA2, [FA4, FA3]),
        ((BUNDLED,), SM90, BUNDLED, [FA4, FA3, FA2]),
        ((FA3, FA2), None, FA3, [FA4]),  # a CPU tensor: no capability to filter by
    ],
)
def test_chain_picks_the_first_usable_and_says_why_it_skipped_the_others(present, capability, expected, skipped):
    backend = Chain(*present).backend
    adapter, why = backend.choose(capability, DQK, DV)
    assert adapter is not None and adapter.kind.name == expected
    assert [w.split(": ", 1)[0] for w in why] == skipped
    for name, reason in zip(skipped, why):
        if name not in present:
            assert reason == f"{name}: not available (ImportError: {name} is not installed)"
    if capability is not None:
        text = backend.describe(capability, SelectorConfig(BF16))
        assert text.startswith(adapter.kind.label)
        assert ("[skipped: " in text) == bool(skipped)


def test_fa4_is_skipped_where_it_is_not_used_with_the_reason():
    backend = Chain(*ALL).backend
    _, why = backend.choose(SM80, DQK, DV)
    assert why[0] == f"flash_attn.cute: {FA4_NOT_USED.format(SM80)}"
    # On SM100, FA4 serves DeepSeek's (192, 128) but not (192, 64); FA3 is Hopper-only; FA2 runs it.
    adapter, why = backend.choose(SM100, 192, 64)
    assert adapter.kind.name == FA2
    assert why == [
        "flash_attn.cute: FlashAttention-4 (flash_attn.cute) on SM100 supports head dims up to 128, (192, 128), "
        "(256, 256), and Dv = 512 with Dqk in (64, 512)",
        "flash_attn_interface: FlashAttention-3 (flash_attn_interface) needs compute capability 9.0 (Hopper), got 10.0",
    ]
    assert (
        backend.describe(SM90, SelectorConfig(BF16))
        == "FlashAttention-4 (flash_attn.cute): native Dv != Dqk, no padding; calls its forward without the autograd "
        "wrapper"
    )


def test_chain_routes_unsupported_dims_past_fa3():
    backend = Chain(FA3, FA2).backend
    # Dv=64 with Dqk=192 is outside FlashAttention-3's Dv != Dqk combinations, so FlashAttention-2 runs it.
    adapter, skipped = backend.choose(SM90, 192, 64)
    assert adapter.kind.name == FA2
    assert skipped[1] == (
        "flash_attn_interface: FlashAttention-3 (flash_attn_interface) supports Dv != Dqk only for Dqk in "
        "(128, 192] with Dv in (96, 128], or Dqk <= 64 with Dv <= 512"
    )
    assert backend.describe(SM90, SelectorConfig(BF16, MLADimensions(128, 64, 64))).startswith(
        "FlashAttention-2 (flash_attn)"
    )
    assert "FlashAttention-3" in backend.describe(SM90, SelectorConfig(BF16))  # DeepSeek's dims stay on FA3


# --- validation -----------------------------------------------------------------------------------------


def _absent(name: str) -> str:
    return f"{name}: not available (ImportError: {name} is not installed)"


def _not_installed(capability, dqk, dv, *why):
    return (
        f"no installed FlashAttention implementation serves compute capability {capability} with head dims "
        f"(Dqk={dqk}, Dv={dv}): " + "; ".join(why)
    )


@pytest.mark.parametrize(
    ("present", "capability", "dims", "dtype", "expected"),
    [
        # The chain covers these; what is installed decides.
        ((FA3,), SM80, (128, 64, 128), BF16, [
            _not_installed(SM80, 192, 128, _absent(FA4), f"{FA3}: " + FA3_NOT_90.format(SM80), _absent(FA2),
                           _absent(BUNDLED))
        ]),
        ((FA4,), SM80, (128, 64, 128), BF16, [
            _not_installed(SM80, 192, 128, f"{FA4}: " + FA4_NOT_USED.format(SM80), _absent(FA3), _absent(FA2),
                           _absent(BUNDLED))
        ]),
        ((FA3, BUNDLED), SM80, (128, 64, 128), BF16, []),
        ((FA2,), SM100, (128, 64, 128), BF16, []),
        ((FA4,), SM100, (128, 64, 128), BF16, []),
        ((FA4,), SM100, (128, 64, 256), BF16, [
            _not_installed(SM100, 192, 256, f"{FA4}: {FA4_LABEL} on SM100 supports head dims up to 128, (192, 128), "
                           "(256, 256), and Dv = 512 with Dqk in (64, 512)", _absent(FA3), _absent(FA2),
                           _absent(BUNDLED))
        ]),
        ((FA3,), SM90, (128, 64, 64), BF16, [
            _not_installed(SM90, 192, 64, _absent(FA4), f"{FA3}: " + FA3_DV_RULE, _absent(FA2), _absent(BUNDLED))
        ]),
        ((BUNDLED,), SM90, (64, 0, 288), BF16, [
            _not_installed(SM90, 64, 288, _absent(FA4), _absent(FA3), _absent(FA2), f"{BUNDLED}: {BUNDLED_LABEL} "
                           "supports head dims up to 256, and the padded head dim max(Dqk, Dv) is 288")
        ]),
        ((FA3,), SM90, (64, 0, 288), BF16, []),  # FA3's (Dqk <= 64, Dv <= 512) family
        ((FA3, FA2), SM90, (128, 64, 64), BF16, []),  # FA2 serves what FA3 does not
        ((FA3, FA2), SM90, (192, 64, 256), BF16, []),  # the wide-head configuration
        # The chain does not cover these, whatever is installed.
        ((FA2,), SM75, (128, 64, 128), BF16, [SM75_RULE]),
        ((FA2,), SM90, (256, 64, 128), BF16, [
            f"head dims (Dqk=320, Dv=128) are not supported: {FA4_LABEL} on SM90 supports head dims from 8 to 256; "
            f"{FA3_LABEL} supports Dqk up to 256; "
            f"{FA2_LABEL} supports head dims up to 256, and the padded head dim max(Dqk, Dv) is 320; "
            f"{BUNDLED_LABEL} supports head dims up to 256, and the padded head dim max(Dqk, Dv) is 320"
        ]),
        ((BUNDLED,), SM80, (128, 60, 128), BF16, [  # FA4 and FA3 do not run on 8.0, so only FA2 rules count
            f"head dims (Dqk=188, Dv=128) are not supported: "
            f"{FA2_LABEL} needs the padded head dim max(Dqk, Dv) = 188 to be a multiple of 8; "
            f"{BUNDLED_LABEL} needs the padded head dim max(Dqk, Dv) = 188 to be a multiple of 8"
        ]),
        ((FA2,), SM90, (128, 64, 128), torch.float32, [
            "dtype float32 is not supported (use bfloat16, float16, float8_e4m3fn)"
        ]),
        ((FA2,), None, (128, 64, 128), BF16, ["runs on CUDA devices only, not on CPU"]),
        ((), SM90, (128, 64, 128), BF16, [NOTHING]),
        ((), SM75, (128, 64, 128), BF16, [NOTHING, SM75_RULE]),
    ],
)  # fmt: skip
def test_validation_reasons(present, capability, dims, dtype, expected):
    config = SelectorConfig(dtype, MLADimensions(*dims))
    assert Chain(*present).backend.reasons(capability, config) == expected


@pytest.mark.parametrize("capability", [SM75, SM80, SM90, SM100, None])
@pytest.mark.parametrize("dims", [(128, 64, 128), (128, 64, 64), (64, 0, 288), (256, 64, 128), (192, 64, 256)])
def test_selection_rules_ignore_what_is_installed(capability, dims):
    config = SelectorConfig(BF16, MLADimensions(*dims))
    seen = [
        Chain(*present).backend.rule_reasons(capability, config) for present in ((), (FA3,), (FA4,), (FA2, BUNDLED))
    ]
    assert seen[0] == seen[1] == seen[2] == seen[3]


def test_invalid_override_names_the_reason():
    with (
        backend_installed(Chain(FA3).backend),
        mla_ops.prefill_backend("FLASH_ATTN"),
        pytest.raises(ValueError) as info,
    ):
        mla_ops.select_backend(SM80, SelectorConfig(BF16))
    assert str(info.value).startswith("Selected MLA prefill backend FLASH_ATTN is not valid for this configuration.")
    assert "needs compute capability 9.0 (Hopper), got 8.0" in str(info.value)


# --- calls, per implementation -----------------------------------------------------------------------------

RAGGED = [0, 5, 17, 0, 33, 1]  # includes zero-length sequences
CHUNK = [4, 0, 21, 3, 0, 9]  # per-sequence slices of a context chunk; seq 1 and 4 have none


def _chunk_inputs(num_heads, strided_v, seed=1, dv=DV, dqk=DQK, dtype=BF16):
    batch = make_batch(RAGGED, num_heads, dqk, dv, dtype, strided_v=strided_v, padding=3, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    _, k, v = make_qkv(sum(CHUNK) + 2, num_heads, dqk, dv, dtype, strided_v=strided_v, generator=gen)
    return batch, k, v, cu_seqlens_of(CHUNK)


@dataclass
class OneCall:
    """What a path ran: the one kernel call the stand-ins recorded, and the inputs the backend was given."""

    call: dict
    batch: RaggedBatch
    k: torch.Tensor
    v: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def run_once(chain: Chain, path: str, heads: int, strided_v: bool, scale: float, bounds: tuple[int, int]) -> OneCall:
    """Run ``path`` on a ragged batch (or its chunk) under :func:`no_host_sync`, passing the max_seqlen
    upper ``bounds`` as they are; checks the result against fp32 math and that one kernel call was made."""
    batch, kc, vc, cu_k = _chunk_inputs(heads, strided_v=strided_v)
    if path == "prefill":
        k, v, cu_k, max_q, max_k = batch.k, batch.v, batch.cu_seqlens, bounds[0], bounds[0]
    else:
        k, v, max_q, max_k = kc, vc, *bounds
    with no_host_sync():
        out, lse = chain.run(path, batch.q, k, v, batch.cu_seqlens, cu_k, max_q, max_k, scale)
    assert_attention_close(out, lse, batch.q, k, v, batch.cu_seqlens, cu_k, scale, path == "prefill")
    (call,) = chain.calls
    return OneCall(call, batch, k, v, cu_k, max_q, max_k)


@pytest.mark.parametrize("path", ["prefill", "chunk"])
@pytest.mark.parametrize("impl", [FA2, BUNDLED])
def test_padded_implementations(impl, path):
    scale = 0.0721
    ran = run_once(Chain(impl), path, 4, strided_v=True, scale=scale, bounds=(64, 30))
    call, v = ran.call, ran.v
    assert call["q"] is ran.batch.q and call["k"] is ran.k
    assert call["cu_seqlens_q"] is ran.batch.cu_seqlens and call["cu_seqlens_k"] is ran.cu_k
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (ran.max_q, ran.max_k)
    assert call["softmax_scale"] == scale and call["causal"] is (path == "prefill")
    assert call["dropout_p"] == 0.0
    if impl == FA2:
        assert call["return_attn_probs"] is True and call["window_size"] == (-1, -1)
    else:
        assert call["return_debug_mask"] is False and call["window_size_left"] is None
    # v reached the kernel Dqk wide, as a window over its own storage: the last Dv columns are v.
    wide = call["v"]
    assert wide.shape == (v.shape[0], 4, DQK)
    assert wide.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert torch.equal(wide[..., DQK - DV :], v)


@pytest.mark.parametrize("variant", ["old", "new", "lse_flag"])
@pytest.mark.parametrize("path", ["prefill", "chunk"])
def test_fa3_native_dv_and_return_conventions(variant, path):
    scale = 0.11
    ran = run_once(Chain(FA3, FA2, BUNDLED, fa3=variant), path, 3, strided_v=False, scale=scale, bounds=(33, 21))
    call = ran.call  # FlashAttention-3 ran, and nothing else
    assert call["v"] is ran.v, "FlashAttention-3 takes Dv != Dqk natively: v must not be padded or copied"
    expected_flag = {"old": None, "new": ("return_attn_probs", True), "lse_flag": ("return_softmax_lse", True)}
    assert call["flag"] == expected_flag[variant]
    assert (call["max_seqlen_q"], call["max_seqlen_k"], call["softmax_scale"]) == (ran.max_q, ran.max_k, scale)
    assert call["causal"] is (path == "prefill")


@pytest.mark.parametrize("path", ["prefill", "chunk"])
@pytest.mark.parametrize("strided_v", [False, True], ids=["contiguous-v", "strided-v"])
def test_fa4_takes_v_as_it_is_and_returns_the_lse_in_the_package_convention(path, strided_v):
    scale = 0.09
    ran = run_once(Chain(*ALL), path, 3, strided_v=strided_v, scale=scale, bounds=(300, 40))
    call = ran.call  # FlashAttention-4 ran, and nothing else
    # Native Dv != Dqk, strided v accepted: the very tensor, no widening, no copy.
    assert call["v"] is ran.v and call["v"].stride() == ran.v.stride()
    assert call["q"] is ran.batch.q and call["k"] is ran.k
    assert call["cu_seqlens_q"] is ran.batch.cu_seqlens and call["cu_seqlens_k"] is ran.cu_k
    assert (call["max_seqlen_q"], call["max_seqlen_k"], call["softmax_scale"]) == (ran.max_q, ran.max_k, scale)
    assert call["causal"] is (path == "prefill") and call["return_lse"] is True


@pytest.mark.parametrize("internal", [True, False], ids=["its-forward", "public-function-only"])
def test_fa4_is_called_through_the_forward_beneath_its_autograd_wrapper(internal):
    chain = Chain(FA4)
    if not internal:  # a release without a forward the adapter recognises
        chain.libraries[FA4] = standins.fa4_module(internal=False)
        chain.backend = FlashAttnBackend(libraries=chain.libraries)
    ran = run_once(chain, "chunk", 3, strided_v=True, scale=0.1, bounds=(40, 40))
    assert ran.call["entry"] == ("_flash_attn_fwd" if internal else "flash_attn_varlen_func")
    assert ran.call["return_lse"] is True and ran.call["v"] is ran.v
    described = chain.backend.describe(SM90, SelectorConfig(BF16))
    assert ("calls its forward without the autograd wrapper" in described) is internal


def test_fa4_forward_needs_every_argument_the_adapter_passes():
    assert fa.fa4_forward(standins.fa4_module().interface) is not None
    assert fa.fa4_forward(standins.fa4_module(internal=False).interface) is None
    older = types.SimpleNamespace(_flash_attn_fwd=lambda q, k, v, cu_seqlens_q=None, cu_seqlens_k=None: None)
    assert fa.fa4_forward(older) is None, "no max_seqlen, softmax_scale, causal or return_lse keywords"
    reordered = types.SimpleNamespace(_flash_attn_fwd=lambda qkv, **kwargs: None)
    assert fa.fa4_forward(reordered) is None
    assert fa.fa4_forward(None) is None


class _AtenOps(TorchDispatchMode):
    """Records the name of every aten op run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["prefill", "chunk"])
@pytest.mark.parametrize(("impl", "fixes_lse"), [(FA4, False), (FA3, True), (FA2, True), (BUNDLED, True)])
def test_the_empty_row_lse_pass_runs_only_where_the_kernel_needs_it(impl, path, fixes_lse):
    # FlashAttention-2 (and FlashAttention-3's softmax epilogue) write +inf for a row with no keys, which
    # an in-place pass turns into the contract's -inf; FlashAttention-4 writes -inf itself, so its calls
    # skip that launch. Causal self-attention has no such rows on any implementation.
    chain = Chain(impl, fa3="new")
    batch, k, v, cu_k = _chunk_inputs(3, strided_v=False)
    if path == "prefill":
        k, v, cu_k = batch.k, batch.v, batch.cu_seqlens
    with _AtenOps() as ops:
        out, lse = chain.run(path, batch.q, k, v, batch.cu_seqlens, cu_k, 64, 30, 0.1)
    assert_attention_close(out, lse, batch.q, k, v, batch.cu_seqlens, cu_k, 0.1, path == "prefill")
    assert ("nan_to_num_.default" in ops.names) == (fixes_lse and path == "chunk"), ops.names


def test_fa3_without_lse_is_a_clear_error():
    chain = Chain(FA3, fa3="no_lse")
    batch = make_batch([5, 3], 2, DQK, DV, BF16)
    with pytest.raises(RuntimeError, match="returned only the output, not the softmax LSE"):
        chain.run("prefill", batch.q, batch.k, batch.v, batch.cu_seqlens, None, 5, 5, 0.1)


def test_old_padded_lse_layout_is_rejected(monkeypatch):
    chain = Chain(FA2)
    module = chain.libraries[FA2]
    real = module.flash_attn_varlen_func

    def padded_lse(*args, **kwargs):
        out, lse, s = real(*args, **kwargs)
        return out, lse.new_zeros((2, lse.shape[0], 5)), s  # flash-attn < 2.5: [B, H, max_seqlen_q]

    monkeypatch.setattr(module, "flash_attn_varlen_func", padded_lse)
    batch = make_batch([5, 3], 2, DQK, DV, BF16)
    with pytest.raises(RuntimeError, match=r"varlen layout float32 \[H, total_q\] = \[2, 8\]"):
        chain.run("prefill", batch.q, batch.k, batch.v, batch.cu_seqlens, None, 5, 5, 0.1)


def test_dv_wider_than_dqk_pads_q_and_k():
    chain = Chain(BUNDLED)
    batch = make_batch(RAGGED, 2, 64, 128, torch.float16, seed=3)
    with no_host_sync():
        out, lse = chain.run("prefill", batch.q, batch.k, batch.v, batch.cu_seqlens, None, 33, 33, 0.125)
    (call,) = chain.calls
    assert call["q"].shape[-1] == call["k"].shape[-1] == 128 and call["v"] is batch.v
    assert torch.equal(call["q"][..., :64], batch.q) and not call["q"][..., 64:].any()
    assert out.dtype == torch.float16
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 0.125, True)


def test_equal_head_dims_are_not_padded():
    chain = Chain(FA2)
    batch = make_batch([7, 2], 2, 128, 128, BF16)
    out, lse = chain.run("prefill", batch.q, batch.k, batch.v, batch.cu_seqlens, None, 7, 7, 0.1)
    assert chain.calls[0]["v"] is batch.v
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 0.1, True)


@pytest.mark.parametrize("impl", [FA4, FA2])
def test_misaligned_q_is_copied_before_the_kernel(impl):
    chain = Chain(impl)
    batch = make_batch([9, 4], 2, DQK, DV, BF16)
    storage = torch.zeros(batch.q.shape[0], 2, DQK + 8, dtype=BF16)
    q = storage[..., 4 : 4 + DQK]  # starts 8 bytes into a 16-byte boundary
    q.copy_(batch.q)
    out, lse = chain.run("prefill", q, batch.k, batch.v, batch.cu_seqlens, None, 9, 9, 0.1)
    assert chain.calls[0]["q"] is not q and chain.calls[0]["q"].is_contiguous()
    assert_attention_close(out, lse, q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 0.1, True)


@pytest.mark.parametrize("case", ["no_tokens", "no_sequences", "no_keys", "max_seqlen_q_0", "max_seqlen_k_0"])
def test_degenerate_shapes_skip_the_kernel(case):
    chain = Chain(FA4, FA2)
    tokens = 0 if case == "no_tokens" else 6
    q, k, v = make_qkv(tokens, 2, DQK, DV, BF16)
    length = 0 if case == "max_seqlen_q_0" else tokens
    cu_q = torch.zeros(1, dtype=torch.int32) if case == "no_sequences" else torch.tensor([0, length], dtype=torch.int32)
    cu_k = torch.zeros_like(cu_q)
    if case == "no_keys":
        k, v = k[:0], v[:0]
    max_q, max_k = length, 0 if case == "max_seqlen_k_0" else tokens
    with no_host_sync():
        out, lse = chain.run("chunk", q, k, v, cu_q, cu_k, max_q, max_k, 0.1)
    assert chain.calls == []
    assert out.shape == (tokens, 2, DV) and lse.shape == (2, tokens)
    assert not out.any() and torch.isneginf(lse).all()


# --- FlashAttention-4's just-in-time compiles and CUDA-graph capture ----------------------------------------


def test_a_compile_under_capture_is_refused_until_warmed_up(monkeypatch):
    chain = Chain(*ALL)
    fa4 = chain.libraries[FA4]
    batch = make_batch([5, 0, 9], 2, DQK, DV, BF16, strided_v=True, padding=3)
    chunk = make_batch([4, 2, 0], 2, DQK, DV, BF16, seed=1)
    # A graph for up to 300 sequences, most of them padding of length 0.
    many = make_batch([2, 3] + [0] * 298, 2, DQK, DV, BF16, strided_v=True, seed=2)
    many_chunk = make_batch([1, 0, 3] + [0] * 297, 2, DQK, DV, BF16, seed=3)

    def captured(b, c, budget: int):
        # The new-tokens path and a chunk, with max_seqlen = a graph's token budget.
        chain.run("prefill", b.q, b.k, b.v, b.cu_seqlens, None, budget, budget, 0.1)
        chain.run("chunk", b.q, c.k, c.v, b.cu_seqlens, c.cu_seqlens, budget, budget, 0.1)

    with standins.capturing(), pytest.raises(RuntimeError) as info:
        captured(batch, chunk, 2048)
    message = str(info.value)
    assert message.startswith("FlashAttention-4 would compile a kernel (bfloat16, Dqk=192, Dv=128, causal=True, ")
    assert "inside CUDA-graph capture" in message and "python -m mla_ops warmup --backend FLASH_ATTN" in message
    assert fa4.compiled == []
    assert fa4.interface.cute.compile.__name__ == "cute_compile", "the refusal must be undone after the call"

    # FlashAttnBackend.warmup compiles what the ops launch. It runs on a CUDA device, simulated here.
    monkeypatch.setattr(DeviceCapability, "of", classmethod(lambda cls, device: SM90))
    chain.backend.warmup(torch.device("cpu"), SelectorConfig(BF16), 2)
    variants = set(fa4.compiled)
    flags = (True, False)
    assert variants == {(BF16, DQK, DV, c, short, wide) for c in flags for short in flags for wide in flags}
    with standins.capturing():
        for budget in (64, 2048):  # within one query tile and beyond it
            captured(batch, chunk, budget)
            captured(many, many_chunk, budget)
    assert len(fa4.compiled) == len(variants), "capture compiled nothing"
    assert all(call["capturing"] for call in fa4.calls[-8:])


def test_eager_calls_compile_on_first_use_only():
    chain = Chain(FA4)
    batch = make_batch([5, 9], 2, 64, 64, torch.float16)
    for _ in range(3):
        chain.run("prefill", batch.q, batch.k, batch.v, batch.cu_seqlens, None, 9, 9, 0.125)
    assert chain.libraries[FA4].compiled == [(torch.float16, 64, 64, True, True, False)]


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
@pytest.mark.parametrize("impl", [FA2, BUNDLED])
def test_nan_in_window_columns_does_not_leak(impl, kind):
    chain = Chain(impl)
    lengths = [4, 0, 7]
    v, extra = _views(kind, tokens=sum(lengths))
    if extra is not None:
        extra.fill_(math.nan)  # the window's extra columns: they may hold anything
    gen = torch.Generator().manual_seed(7)
    q, k, _ = make_qkv(sum(lengths), 3, DQK, DV, BF16, generator=gen)
    cu = cu_seqlens_of(lengths)
    out, lse = chain.run("prefill", q, k, v, cu, None, 7, 7, 0.09)
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


# --- fp8 through FlashAttention-4 (SM100) ------------------------------------------------------------------


FP8 = torch.float8_e4m3fn


def _fp8_call(causal: bool, per_head: bool, heads: int = 3):
    """A quantised batch on CPU, the call and the op's scales (per-head factors, or one as a stride-0 [H] view)."""
    from fp8_contract import fp8_batch

    from mla_ops.backends.base import Fp8Scales

    b = fp8_batch([5, 0, 9, 1], None if causal else [7, 3, 0, 12], heads, padding=2, per_head=per_head, seed=4)
    call = VarlenCall(b.q, b.k, b.v, b.cu_seqlens_q, b.cu_seqlens_k, b.max_seqlen_q, b.max_seqlen_k, 0.09, causal)
    return call, [d.reshape(-1).expand(heads) for d in b.descales], Fp8Scales


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-tensor"])
@pytest.mark.parametrize("out_dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_runs_flash_attention_4s_forward_with_descales_per_sequence_and_head(causal, per_head, out_dtype):
    """FlashAttention-4's forward gets each factor as float32 [B, H] (the op's [H] repeated over the sequences),
    and the result is REFERENCE's on the same quantised inputs; its bf16 output is converted for fp16."""
    from mla_ops.backends.reference import ReferenceBackend

    chain = Chain(FA4)
    call, descales, scales_type = _fp8_call(causal, per_head)
    scales = scales_type(*descales, out_dtype)
    out, lse = chain.backend.attention_fp8(call, scales)
    want_out, want_lse = ReferenceBackend().attention_fp8(call, scales)
    (record,) = [c for c in chain.calls if c.get("fp8")]
    batch = call.cu_seqlens_q.shape[0] - 1
    for got, factor in zip(record["descales"], descales):
        assert got.shape == (batch, 3) and got.dtype == torch.float32 and torch.equal(got, factor.expand(batch, 3))
    rows = int(call.cu_seqlens_q[-1])
    assert out.dtype == out_dtype and out.shape == want_out.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(out[:rows].float(), want_out[:rows].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[:, :rows], want_lse[:, :rows], atol=1e-4, rtol=1e-4)


def test_fp8_without_keys_returns_zeros_in_the_output_dtype():
    chain = Chain(FA4)
    call, descales, scales_type = _fp8_call(False, True)
    empty = call._replace(k=call.k[:0], v=call.v[:0], max_seqlen_k=0)
    out, lse = chain.backend.attention_fp8(empty, scales_type(*descales, torch.float16))
    assert out.dtype == torch.float16 and not out.any() and torch.isneginf(lse).all()
    assert not chain.calls, "nothing to launch"


def test_fp8_rules_name_sm100_and_flash_attention_4():
    """fp8 runs on SM100 only and through FlashAttention-4 only, whose forward must take the descale factors:
    each gap is a reason, and info says the path is untested on hardware."""
    fp8 = SelectorConfig(FP8, MLADimensions(128, 64, 128))
    backend = Chain(FA4).backend
    assert backend.reasons(SM100, fp8) == []
    assert "untested on hardware" in backend.describe(SM100, fp8)
    assert "untested" not in backend.describe(SM100, SelectorConfig(BF16, MLADimensions(128, 64, 128)))
    assert backend.reasons(SM90, fp8) == [
        "dtype float8_e4m3fn runs on SM100 (compute capability 10.x) only: FlashAttention-4's fp8 kernels are "
        "Blackwell's, not 9.0's"
    ]
    # Head dims FlashAttention-4 does not serve on SM100, though the rules let FlashAttention-2 serve them in bf16.
    wide = SelectorConfig(FP8, MLADimensions(192, 64, 128))  # (256, 128)
    assert backend.rule_reasons(SM100, SelectorConfig(BF16, MLADimensions(192, 64, 128))) == []
    (reason,) = backend.reasons(SM100, wide)
    assert reason.startswith(f"fp8 inputs run on FlashAttention-4 only: {FA4_LABEL} on SM100 supports")
    # FlashAttention-2 alone, and a FlashAttention-4 without the forward that takes descales.
    for chain in (Chain(FA2), _fa4_without_forward()):
        (reason,) = chain.backend.reasons(SM100, fp8)
        assert reason.startswith("fp8 inputs need FlashAttention-4 (pip install flash-attn-4) whose forward takes")
        call, descales, scales_type = _fp8_call(True, True)
        with pytest.raises(ValueError, match="FLASH_ATTN cannot run fp8 inputs here: fp8 inputs need FlashAtt"):
            chain.backend.attention_fp8(call, scales_type(*descales, BF16))


def _fa4_without_forward() -> Chain:
    chain = Chain(FA4)
    chain.libraries[FA4] = standins.fa4_module(internal=False)
    chain.backend = FlashAttnBackend(libraries=chain.libraries)
    return chain


def test_fp8_is_refused_by_flash_attention_4_off_sm100():
    """What the stand-in models of flash-attn-4 4.0.0b36: fp8 inputs on another architecture fail its assert."""
    library = standins.fa4_module(arch=90)
    call, descales, scales_type = _fp8_call(True, True)
    backend = FlashAttnBackend(libraries={FA4: library})
    with pytest.raises(AssertionError, match="FP8 is only supported on SM100"):
        backend.attention_fp8(call, scales_type(*descales, BF16))


def test_fp8_warmup_compiles_what_fp8_calls_launch(monkeypatch):
    """``warmup`` with an fp8 config compiles FlashAttention-4's fp8 variants, so that a capture compiles none."""
    chain = Chain(FA4)
    fa4 = chain.libraries[FA4]
    monkeypatch.setattr(DeviceCapability, "of", classmethod(lambda cls, device: SM100))
    chain.backend.warmup(torch.device("cpu"), SelectorConfig(FP8), 2)
    compiled = set(fa4.compiled)
    assert compiled and all(variant[0] == FP8 for variant in compiled)
    call, descales, scales_type = _fp8_call(True, True, heads=2)
    with standins.capturing():
        for budget in (64, 2048):
            chain.backend.attention_fp8(call._replace(max_seqlen_q=budget, max_seqlen_k=budget),
                                        scales_type(*descales, BF16))  # fmt: skip
    assert set(fa4.compiled) == compiled, "capture compiled nothing"
    assert fa4.calls[-1]["capturing"] and fa4.calls[-1]["fp8"]
