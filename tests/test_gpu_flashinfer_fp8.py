"""FlashInfer's own fp8 prefill on SM90 at MLA's head sizes (``pytest -m gpu``): whether FLASHINFER could serve the
fp8 ops. With FlashInfer 0.7.2 it cannot (docs/design/fp8.md, Other backends): the fp8 kernels of its SM90 ragged
prefill need ``Dqk == Dv``, one of 64, 128 and 256. The test fails where a FlashInfer release runs (192, 128) e4m3
ragged prefill within the fp8 accuracy contract: the signal to list fp8 in FLASHINFER's ``dtypes``."""

from __future__ import annotations

import pytest
import torch
from fp8_contract import contract_errors, fp8_batch

from mla_ops.specs import FP8_DTYPE

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
SCALE = 192**-0.5


def test_flashinfer_fp8_prefill_does_not_serve_mla_head_sizes() -> None:
    fi = pytest.importorskip("flashinfer", reason="FlashInfer is not installed, so there is nothing to probe")
    if torch.cuda.get_device_capability(DEVICE) != (9, 0):
        pytest.skip("FlashInfer's fp8 prefill kernels probed here (backend 'fa3') are SM90's")
    heads = 16
    batch = fp8_batch([300, 0, 77, 1], None, heads, device=DEVICE, per_head=True, outliers=True, seed=3)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=DEVICE)
    wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
    try:
        wrapper.plan(
            batch.cu_seqlens_q, batch.cu_seqlens_k, heads, heads, 192, head_dim_vo=128, causal=True, sm_scale=SCALE,
            q_data_type=FP8_DTYPE, kv_data_type=FP8_DTYPE, o_data_type=torch.bfloat16,
        )  # fmt: skip
        # The fp8 kernels take per-head descale tensors after q, k and v.
        out = wrapper.run(batch.q, batch.k, batch.v, *batch.descales)
        torch.cuda.synchronize()
    except Exception as exc:  # any refusal (a build error, a check) answers the probe
        print(f"FlashInfer {fi.__version__} refuses (192, 128) e4m3 ragged prefill: {type(exc).__name__}: {exc}")
        return
    error, bound = contract_errors(batch, out, True, SCALE)
    assert not error <= bound, (
        f"FlashInfer {fi.__version__} runs (192, 128) e4m3 ragged prefill on SM90 within the fp8 contract (max error "
        f"{error:.4f} <= {bound:.4f}): FLASHINFER can serve the fp8 ops; list fp8 in its dtypes, pass the descales, "
        "and update docs/design/fp8.md"
    )
