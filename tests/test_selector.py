"""The selector on simulated devices: priority lists, choices, overrides, errors and caching.

Snapshots are expecttest inline snapshots; after an intended change, regenerate them with
``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_selector.py``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import expecttest
import pytest
import standins
import torch

import mla_ops
from mla_ops import DeviceCapability, MLADimensions, PrefillBackendEnum, SelectorConfig
from mla_ops import selector as sel
from mla_ops.backends.flash_attn import FlashAttnBackend
from mla_ops.backends.flashinfer import FlashInferBackend
from mla_ops.backends.registry import replace_backend
from mla_ops.cli.info import selection_rules

SM80, SM89, SM90, SM100, SM75 = (DeviceCapability(*c) for c in ((8, 0), (8, 9), (9, 0), (10, 0), (7, 5)))
DEEPSEEK = MLADimensions(128, 64, 128)
WIDE = MLADimensions(192, 64, 256)
NON_MLA = MLADimensions(128, 0, 128)  # plain multi-head attention with 128-channel heads
ODD = MLADimensions(256, 64, 128)  # Dqk 320: wider than any kernel library serves


def _summary(capability, dtype, dims) -> str:
    order = [b.name for b in sel.backend_priorities(capability, SelectorConfig(dtype, dims))]
    if not order:
        return "[] -> none (no priority list for this capability)"
    rules = selection_rules(capability, SelectorConfig(dtype, dims)).splitlines()
    return f"{order} -> {rules[-1].split(': ', 1)[-1]}"


def _cli_info(*args: str) -> str:
    """What ``python -m mla_ops info`` with ``args`` prints, with no backend forced; it must succeed."""
    result = subprocess.run(
        [sys.executable, "-m", "mla_ops", "info", *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, sel.ENV_VAR: ""},
    )
    return result.stdout


def _cli_rules(*args: str) -> str:
    """The selection-rules block of ``python -m mla_ops info`` with ``args`` (it ignores what is installed)."""
    stdout = _cli_info(*args)
    start = stdout.index("Selection rules")
    return stdout[start : stdout.index("\n\n", start)]


class TestSnapshots(expecttest.TestCase):
    def test_priorities_and_choices(self) -> None:
        lines = []
        for cap in (None, SM80, SM89, SM90, SM100, SM75):
            for dims in (DEEPSEEK, WIDE, NON_MLA, ODD):
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    name = "cpu" if cap is None else f"sm{cap.major}{cap.minor}"
                    lines.append(f"{name} {tuple(dims)} {str(dtype)[6:]}: {_summary(cap, dtype, dims)}")
        self.assertExpectedInline(
            "\n".join(lines),
            """\
cpu (128, 64, 128) bfloat16: ['REFERENCE'] -> REFERENCE
cpu (128, 64, 128) float16: ['REFERENCE'] -> REFERENCE
cpu (128, 64, 128) float32: ['REFERENCE'] -> none
cpu (192, 64, 256) bfloat16: ['REFERENCE'] -> REFERENCE
cpu (192, 64, 256) float16: ['REFERENCE'] -> REFERENCE
cpu (192, 64, 256) float32: ['REFERENCE'] -> none
cpu (128, 0, 128) bfloat16: ['REFERENCE'] -> REFERENCE
cpu (128, 0, 128) float16: ['REFERENCE'] -> REFERENCE
cpu (128, 0, 128) float32: ['REFERENCE'] -> none
cpu (256, 64, 128) bfloat16: ['REFERENCE'] -> REFERENCE
cpu (256, 64, 128) float16: ['REFERENCE'] -> REFERENCE
cpu (256, 64, 128) float32: ['REFERENCE'] -> none
sm80 (128, 64, 128) bfloat16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm80 (128, 64, 128) float16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm80 (128, 64, 128) float32: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm80 (192, 64, 256) bfloat16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm80 (192, 64, 256) float16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm80 (192, 64, 256) float32: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm80 (128, 0, 128) bfloat16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm80 (128, 0, 128) float16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm80 (128, 0, 128) float32: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm80 (256, 64, 128) bfloat16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm80 (256, 64, 128) float16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm80 (256, 64, 128) float32: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm89 (128, 64, 128) bfloat16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm89 (128, 64, 128) float16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm89 (128, 64, 128) float32: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm89 (192, 64, 256) bfloat16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm89 (192, 64, 256) float16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm89 (192, 64, 256) float32: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm89 (128, 0, 128) bfloat16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm89 (128, 0, 128) float16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm89 (128, 0, 128) float32: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm89 (256, 64, 128) bfloat16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm89 (256, 64, 128) float16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm89 (256, 64, 128) float32: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm90 (128, 64, 128) bfloat16: ['FLASHINFER', 'FLASH_ATTN', 'TRITON'] -> FLASHINFER
sm90 (128, 64, 128) float16: ['FLASHINFER', 'FLASH_ATTN', 'TRITON'] -> FLASHINFER
sm90 (128, 64, 128) float32: ['FLASHINFER', 'FLASH_ATTN', 'TRITON'] -> none
sm90 (192, 64, 256) bfloat16: ['FLASHINFER', 'FLASH_ATTN', 'TRITON'] -> FLASHINFER
sm90 (192, 64, 256) float16: ['FLASHINFER', 'FLASH_ATTN', 'TRITON'] -> FLASHINFER
sm90 (192, 64, 256) float32: ['FLASHINFER', 'FLASH_ATTN', 'TRITON'] -> none
sm90 (128, 0, 128) bfloat16: ['FLASHINFER', 'FLASH_ATTN', 'TRITON'] -> FLASHINFER
sm90 (128, 0, 128) float16: ['FLASHINFER', 'FLASH_ATTN', 'TRITON'] -> FLASHINFER
sm90 (128, 0, 128) float32: ['FLASHINFER', 'FLASH_ATTN', 'TRITON'] -> none
sm90 (256, 64, 128) bfloat16: ['FLASHINFER', 'FLASH_ATTN', 'TRITON'] -> none
sm90 (256, 64, 128) float16: ['FLASHINFER', 'FLASH_ATTN', 'TRITON'] -> none
sm90 (256, 64, 128) float32: ['FLASHINFER', 'FLASH_ATTN', 'TRITON'] -> none
sm100 (128, 64, 128) bfloat16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm100 (128, 64, 128) float16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm100 (128, 64, 128) float32: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm100 (192, 64, 256) bfloat16: ['FLASHINFER', 'FLASH_ATTN', 'TRITON'] -> FLASHINFER
sm100 (192, 64, 256) float16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm100 (192, 64, 256) float32: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm100 (128, 0, 128) bfloat16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm100 (128, 0, 128) float16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> FLASH_ATTN
sm100 (128, 0, 128) float32: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm100 (256, 64, 128) bfloat16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm100 (256, 64, 128) float16: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm100 (256, 64, 128) float32: ['FLASH_ATTN', 'FLASHINFER', 'TRITON'] -> none
sm75 (128, 64, 128) bfloat16: [] -> none (no priority list for this capability)
sm75 (128, 64, 128) float16: [] -> none (no priority list for this capability)
sm75 (128, 64, 128) float32: [] -> none (no priority list for this capability)
sm75 (192, 64, 256) bfloat16: [] -> none (no priority list for this capability)
sm75 (192, 64, 256) float16: [] -> none (no priority list for this capability)
sm75 (192, 64, 256) float32: [] -> none (no priority list for this capability)
sm75 (128, 0, 128) bfloat16: [] -> none (no priority list for this capability)
sm75 (128, 0, 128) float16: [] -> none (no priority list for this capability)
sm75 (128, 0, 128) float32: [] -> none (no priority list for this capability)
sm75 (256, 64, 128) bfloat16: [] -> none (no priority list for this capability)
sm75 (256, 64, 128) float16: [] -> none (no priority list for this capability)
sm75 (256, 64, 128) float32: [] -> none (no priority list for this capability)""",
        )

    def test_rules_table_sm90(self) -> None:
        self.assertExpectedInline(
            selection_rules(SM90, SelectorConfig(torch.bfloat16, DEEPSEEK)),
            """\
Selection rules for compute capability 9.0 and SelectorConfig(dtype=torch.bfloat16, mla_dimensions=MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))
  order  backend     covers this config
  1      FLASHINFER  yes
  2      FLASH_ATTN  yes
  3      TRITON      yes
  -      REFERENCE   yes (explicit override only)
  (FLASH_ATTN ranks after TRITON where the FlashAttention it runs pads v: FlashAttention-2)
  order from: measured by this project on an H200 (benchmarks/results/h200/results.md at commit 8fe6e83, 2026-12-01): FLASHINFER (fa3) fastest on 14 of 25 attention shapes, FLASH_ATTN (FlashAttention-4) on the other 11
  automatic choice when every library is installed: FLASHINFER""",
        )

    def test_rules_table_sm100(self) -> None:
        self.assertExpectedInline(
            selection_rules(SM100, SelectorConfig(torch.bfloat16, DEEPSEEK)),
            """\
Selection rules for compute capability 10.0 and SelectorConfig(dtype=torch.bfloat16, mla_dimensions=MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))
  order  backend     covers this config
  1      FLASH_ATTN  yes
  2      FLASHINFER  yes
  3      TRITON      yes
  -      REFERENCE   yes (explicit override only)
  order from: the seed's order (FLASH_ATTN, TRTLLM_RAGGED, FLASHINFER; TRTLLM_RAGGED's kernel, FlashInfer's trtllm_ragged_attention_deepseek, runs inside FLASHINFER here) and published data, not measured by this project (no Blackwell GPU has run any backend here): vLLM's SM100 default MLA prefill is FlashAttention-4, its B200 8k prefill 0.415 ms with FA4 vs 0.555 ms with FlashInfer; FA4 reports 1441 TFLOP/s at (192, 128) on B200
  automatic choice when every library is installed: FLASH_ATTN""",
        )
        self.assertExpectedInline(
            selection_rules(SM100, SelectorConfig(torch.bfloat16, WIDE)),
            """\
Selection rules for compute capability 10.0 and SelectorConfig(dtype=torch.bfloat16, mla_dimensions=MLADimensions(qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256))
  order  backend     covers this config
  1      FLASHINFER  yes
  2      FLASH_ATTN  yes
  3      TRITON      yes
  -      REFERENCE   yes (explicit override only)
  (FLASHINFER ranks after FLASH_ATTN where its FlashInfer lacks trtllm_ragged_attention_deepseek)
  order from: the seed's order for its (192, 64, 256) configuration: TRTLLM_RAGGED, FLASH_ATTN, FLASHINFER. TRTLLM_RAGGED is FlashInfer's trtllm_ragged_attention_deepseek, which FLASHINFER runs here in bf16 only (FLASH_ATTN leads where it does not run). Not measured by this project (no Blackwell GPU has run any backend here)
  automatic choice when every library is installed: FLASHINFER""",
        )

    def test_info_cli_on_sm100_follows_the_seed_and_names_its_evidence(self) -> None:
        """``python -m mla_ops info --capability 10.0``, for DeepSeek's dims and for the seed's (192, 64, 256),
        prints exactly the rules whose snapshots the test above holds."""
        self.assertEqual(
            _cli_rules("--capability", "10.0"), selection_rules(SM100, SelectorConfig(torch.bfloat16, DEEPSEEK))
        )
        self.assertEqual(
            _cli_rules("--capability", "10.0", "--dims", "192,64,256"),
            selection_rules(SM100, SelectorConfig(torch.bfloat16, WIDE)),
        )

    def test_rules_table_unsupported_platform(self) -> None:
        self.assertExpectedInline(
            selection_rules(SM75, SelectorConfig(torch.bfloat16, DEEPSEEK)),
            """\
Selection rules for compute capability 7.5 and SelectorConfig(dtype=torch.bfloat16, mla_dimensions=MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))
  no MLA prefill backend priority list for compute capability 7.5; automatic selection covers SM80/SM86/SM89 (Ampere, Ada), SM90 (Hopper) and SM100 (Blackwell). Set MLA_OPS_PREFILL_BACKEND to force a backend that is valid here""",
        )


@pytest.mark.usefixtures("all_installed")
class TestErrorMessages(expecttest.TestCase):
    def test_no_valid_backend_names_config_and_every_reason(self) -> None:
        self.assertExpectedRaisesInline(
            ValueError,
            lambda: sel.select_backend(SM90, SelectorConfig(torch.float32, DEEPSEEK)),
            """No valid MLA prefill backend found with SelectorConfig(dtype=torch.float32, mla_dimensions=MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)). Reasons: {FLASHINFER: [dtype float32 is not supported (use bfloat16, float16)], FLASH_ATTN: [dtype float32 is not supported (use bfloat16, float16, float8_e4m3fn)], TRITON: [dtype float32 is not supported (use bfloat16, float16, float8_e4m3fn)]}.""",
        )

    def test_no_valid_backend_for_odd_dims(self) -> None:
        self.assertExpectedRaisesInline(
            ValueError,
            lambda: sel.select_backend(SM90, SelectorConfig(torch.bfloat16, ODD)),
            """No valid MLA prefill backend found with SelectorConfig(dtype=torch.bfloat16, mla_dimensions=MLADimensions(qk_nope_head_dim=256, qk_rope_head_dim=64, v_head_dim=128)). Reasons: {FLASHINFER: [head dims (Dqk, Dv) = (320, 128) have no FlashInfer ragged prefill kernel: fa2/fa3 are built for Dqk == Dv in (64, 128, 256) and for DeepSeek's (192, 128)], FLASH_ATTN: [head dims (Dqk=320, Dv=128) are not supported: FlashAttention-4 (flash_attn.cute) on SM90 supports head dims from 8 to 256; FlashAttention-3 (flash_attn_interface) supports Dqk up to 256; FlashAttention-2 (flash_attn) supports head dims up to 256, and the padded head dim max(Dqk, Dv) is 320; PyTorch's bundled FlashAttention-2 (torch.ops.aten._flash_attention_forward) supports head dims up to 256, and the padded head dim max(Dqk, Dv) is 320], TRITON: [qk head dim (qk_nope + qk_rope) 320 exceeds 256]}.""",
        )

    def test_unsupported_platform(self) -> None:
        self.assertExpectedRaisesInline(
            ValueError,
            lambda: sel.select_backend(SM75, SelectorConfig(torch.bfloat16, DEEPSEEK)),
            """No valid MLA prefill backend found with SelectorConfig(dtype=torch.bfloat16, mla_dimensions=MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)): no MLA prefill backend priority list for compute capability 7.5; automatic selection covers SM80/SM86/SM89 (Ampere, Ada), SM90 (Hopper) and SM100 (Blackwell). Set MLA_OPS_PREFILL_BACKEND to force a backend that is valid here.""",
        )

    def test_invalid_override(self) -> None:
        with mla_ops.prefill_backend("FLASHINFER"):
            self.assertExpectedRaisesInline(
                ValueError,
                lambda: sel.select_backend(SM90, SelectorConfig(torch.bfloat16, ODD)),
                """Selected MLA prefill backend FLASHINFER is not valid for this configuration. Reason: ["head dims (Dqk, Dv) = (320, 128) have no FlashInfer ragged prefill kernel: fa2/fa3 are built for Dqk == Dv in (64, 128, 256) and for DeepSeek's (192, 128)"]""",
            )

    def test_unknown_backend_name(self) -> None:
        self.assertExpectedRaisesInline(
            ValueError,
            lambda: mla_ops.set_prefill_backend("FLASH"),
            """unknown MLA prefill backend 'FLASH'; choose one of: REFERENCE, TRITON, FLASH_ATTN, FLASHINFER""",
        )


def test_choices_match_the_rules_when_everything_is_installed(all_installed) -> None:
    for cap in (SM80, SM89, SM90, SM100):
        for dims in (DEEPSEEK, WIDE, NON_MLA):
            config = SelectorConfig(torch.bfloat16, dims)
            first = selection_rules(cap, config).splitlines()[-1].split(": ", 1)[1]
            assert sel.select_backend(cap, config).name == first


def test_missing_library_moves_selection_down_the_list(monkeypatch: pytest.MonkeyPatch, all_installed) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    with sel.backend_installed(FlashInferBackend()):
        # FlashAttention-4 is among the stand-ins: FLASH_ATTN runs it natively and comes next on SM90.
        assert sel.select_backend(SM90, SelectorConfig(torch.bfloat16, DEEPSEEK)).name == "FLASH_ATTN"


@pytest.mark.parametrize(
    ("dims", "dtype", "trtllm", "expected"),
    [
        (DEEPSEEK, torch.bfloat16, True, "FLASH_ATTN"),  # the seed: FLASH_ATTN (FA4) first for (192, 128)
        (WIDE, torch.bfloat16, True, "FLASHINFER"),  # the seed: TRTLLM_RAGGED first for (256, 256)
        (WIDE, torch.bfloat16, False, "FLASH_ATTN"),  # ... where FlashInfer has that kernel
        (WIDE, torch.float16, True, "FLASH_ATTN"),  # ... and runs it: bf16 only
    ],
)
def test_sm100_follows_the_seed(all_installed, dims, dtype, trtllm, expected) -> None:
    flashinfer = FlashInferBackend(library=standins.flashinfer_module(trtllm=trtllm), workspace_bytes=1 << 20)
    with sel.backend_installed(flashinfer):
        assert sel.select_backend(SM100, SelectorConfig(dtype, dims)).name == expected
        # Without FlashAttention, FLASHINFER is next whatever kernel it runs.
        with sel.backend_installed(FlashAttnBackend(libraries={})):
            assert sel.select_backend(SM100, SelectorConfig(dtype, dims)).name == "FLASHINFER"


def test_info_says_where_each_order_comes_from() -> None:
    config = SelectorConfig(torch.bfloat16, DEEPSEEK)
    assert "order from: measured by this project on an H200" in selection_rules(SM90, config)
    for dims in (DEEPSEEK, WIDE):
        rules = selection_rules(SM100, SelectorConfig(torch.bfloat16, dims))
        assert "order from: the seed's order" in rules and "not measured by this project" in rules.lower()
    assert "order from: not measured by this project" in selection_rules(SM80, config)
    assert "order from" not in selection_rules(None, config)


@pytest.mark.parametrize(
    ("present", "expected"),
    [(("flash_attn.cute",), "FLASH_ATTN"), (("torch.ops.aten._flash_attention_forward",), "TRITON")],
)
def test_sm90_ranks_a_padding_flash_attn_after_triton(monkeypatch, all_installed, present, expected) -> None:
    # Without FlashInfer, FLASH_ATTN is next on SM90 only where it runs Dv != Dqk natively; through a
    # FlashAttention-2 that pads v it measured half TRITON's speed, so TRITON goes first then.
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    flash_attn = FlashAttnBackend(libraries=standins.flash_attn_libraries(*present))
    with sel.backend_installed(FlashInferBackend()), sel.backend_installed(flash_attn):
        assert sel.select_backend(SM90, SelectorConfig(torch.bfloat16, DEEPSEEK)).name == expected
        if "torch.ops.aten._flash_attention_forward" in present:  # the rule is SM90's: SM80 keeps FLASH_ATTN first
            assert sel.select_backend(SM80, SelectorConfig(torch.bfloat16, DEEPSEEK)).name == "FLASH_ATTN"


@contextlib.contextmanager
def _fresh_instance(member: PrefillBackendEnum):
    """Drop the process's instance of ``member`` for the block, so that its module is imported again."""
    previous = replace_backend(member, None)
    sel.clear_cache()
    try:
        yield
    finally:
        replace_backend(member, previous)
        sel.clear_cache()


def test_a_backend_module_that_cannot_import_gives_the_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mla_ops.backends.triton", None)
    with _fresh_instance(PrefillBackendEnum.TRITON):
        backend, reasons = sel.validate_backend(PrefillBackendEnum.TRITON, SM90, SelectorConfig(torch.bfloat16))
        assert backend is None
        assert reasons == ["ImportError: import of mla_ops.backends.triton halted; None in sys.modules"]
        with mla_ops.prefill_backend("TRITON"), pytest.raises(ValueError, match=r"import of mla_ops\.backends\.triton"):
            sel.select_backend(SM90, SelectorConfig(torch.bfloat16))


def test_cpu_uses_reference() -> None:
    config = SelectorConfig(torch.bfloat16, DEEPSEEK)
    assert sel.backend_priorities(None, config) == [PrefillBackendEnum.REFERENCE]
    assert sel.select_backend(None, config).name == "REFERENCE"


def test_cpu_runs_reference_whatever_is_forced_but_a_misspelt_name_still_fails(monkeypatch) -> None:
    config = SelectorConfig(torch.bfloat16, DEEPSEEK)
    with mla_ops.prefill_backend("FLASHINFER"):
        assert sel.select_backend(None, config).name == "REFERENCE"
        assert sel.route(torch.device("cpu"), torch.bfloat16, 192, 128).name == "REFERENCE"
    monkeypatch.setenv(sel.ENV_VAR, "FLASHINFR")
    with pytest.raises(ValueError, match=r"MLA_OPS_PREFILL_BACKEND='FLASHINFR': unknown MLA prefill backend"):
        sel.select_backend(None, config)


# --- overrides ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("all_installed")
class TestOverride:
    config = SelectorConfig(torch.bfloat16, DEEPSEEK)

    def test_env_var(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(sel.ENV_VAR, "flash_attn")
        assert sel.select_backend(SM90, self.config).name == "FLASH_ATTN"

    def test_setter_wins_over_env_var(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(sel.ENV_VAR, "FLASH_ATTN")
        mla_ops.set_prefill_backend("TRITON")
        assert sel.select_backend(SM90, self.config).name == "TRITON"
        mla_ops.set_prefill_backend(None)
        assert sel.select_backend(SM90, self.config).name == "FLASH_ATTN"

    def test_context_manager_restores(self) -> None:
        auto = sel.select_backend(SM90, self.config).name
        with mla_ops.prefill_backend(PrefillBackendEnum.REFERENCE):
            assert sel.select_backend(SM90, self.config).name == "REFERENCE"
            with mla_ops.prefill_backend("TRITON"):
                assert sel.select_backend(SM90, self.config).name == "TRITON"
            assert sel.select_backend(SM90, self.config).name == "REFERENCE"
        assert sel.select_backend(SM90, self.config).name == auto

    def test_invalid_override_never_falls_back(self) -> None:
        # FLASH_ATTN's FA3/FA2 kernels need SM80+; on SM75 the override must fail, not pick another.
        with (
            mla_ops.prefill_backend("FLASH_ATTN"),
            pytest.raises(ValueError, match="Selected MLA prefill backend FLASH_ATTN is not valid"),
        ):
            sel.select_backend(SM75, self.config)

    def test_invalid_env_var_name(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(sel.ENV_VAR, "FASTEST")
        with pytest.raises(ValueError, match="unknown MLA prefill backend 'FASTEST'; choose one of: REFERENCE, TRITON"):
            sel.select_backend(SM90, self.config)


# --- caching ------------------------------------------------------------------------------------


def test_auto_selection_runs_once_per_configuration(monkeypatch: pytest.MonkeyPatch, all_installed) -> None:
    calls = []
    real = sel.validate_backend

    def counting(backend, capability, config):
        calls.append((backend, capability, config))
        return real(backend, capability, config)

    monkeypatch.setattr(sel, "validate_backend", counting)
    a = SelectorConfig(torch.bfloat16, DEEPSEEK)
    b = SelectorConfig(torch.float16, DEEPSEEK)
    for _ in range(50):
        sel.select_backend(SM90, a)
        sel.select_backend(SM90, b)
        sel.select_backend(SM80, a)
    distinct = {(cap, cfg) for _, cap, cfg in calls}
    assert distinct == {(SM90, a), (SM90, b), (SM80, a)}
    # One walk of the priority list per configuration, stopping at the first valid backend.
    assert len(calls) == 3


def test_routing_looks_up_a_cache_after_the_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = sel.routing_entry
    monkeypatch.setattr(sel, "routing_entry", lambda cap, cfg, *a: calls.append(cfg) or real(cap, cfg, *a))
    q = torch.empty(4, 2, 192, dtype=torch.bfloat16)
    v = torch.empty(4, 2, 128, dtype=torch.bfloat16)
    for _ in range(100):
        assert sel.backend_for(q, v).name == "REFERENCE"
    assert len(calls) == 1
    mla_ops.set_prefill_backend(None)  # changing the override clears the route cache
    sel.backend_for(q, v)
    assert len(calls) == 2


# --- the CLI prints the snapshot tables -----------------------------------------------------------


@pytest.mark.parametrize(("capability", "expected_cap"), [("9.0", SM90), ("10.0", SM100), ("8.0", SM80)])
def test_info_cli_prints_the_rules_table(capability, expected_cap) -> None:
    stdout = _cli_info("--capability", capability)
    assert selection_rules(expected_cap, SelectorConfig(torch.bfloat16, DEEPSEEK)) in stdout
    assert "On this machine (compute capability" in stdout
    assert "Dispatch keys of torch.ops.mla.*" in stdout


def test_info_cli_rejects_bad_capability() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mla_ops", "info", "--capability", "nine"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "cannot parse compute capability 'nine'; write it as MAJOR.MINOR, e.g. 9.0" in result.stderr
