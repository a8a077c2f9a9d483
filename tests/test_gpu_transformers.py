"""attn_implementation="mla_ops" in transformers models on a GPU, for every CUDA backend.

The cases of ``tests/transformers_cases.py`` (as on CPU, with longer sequences), each with one backend
forced by ``mla_ops.prefill_backend``; a backend that is not valid on this machine is skipped with its
reasons. Plus: padding positions are 0 (the CUDA kernels leave padding rows unspecified), the eager
attention function reads nothing back to the host, and it compiles with fullgraph=True.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import transformers_cases as cases
from transformers_cases import needs_transformers

import mla_ops
from mla_ops.backends.registry import PrefillBackendEnum
from mla_ops.selector import validate_backend
from mla_ops.specs import DeviceCapability, MLADimensions, SelectorConfig

pytestmark = [pytest.mark.gpu, needs_transformers]

BACKENDS = ["TRITON", "FLASH_ATTN", "FLASHINFER"]
DTYPES = [torch.bfloat16, torch.float16]
KINDS = ["deepseek", "llama"]
HEAD_DIMS = {"deepseek": (192, 128), "llama": (64, 64)}


def _require(backend: str, dtype: torch.dtype, head_dims: tuple[int, int]) -> None:
    capability = DeviceCapability.of(torch.device("cuda"))
    config = SelectorConfig(dtype, MLADimensions.from_head_dims(*head_dims))
    _, reasons = validate_backend(PrefillBackendEnum[backend], capability, config)
    if reasons:
        pytest.skip(f"{backend} is not valid here for {config!r}: {reasons}")


_trios: dict[tuple[str, torch.dtype], cases.Trio] = {}


@pytest.fixture(params=list(itertools.product(KINDS, DTYPES, BACKENDS)), ids=lambda p: f"{p[0]}-{str(p[1])[6:]}-{p[2]}")
def model(request):
    """Each tiny model on CUDA, in bf16 and fp16, with each backend forced while the test runs;
    skipped when the backend cannot serve the model's head dims here."""
    kind, dtype, backend = request.param
    _require(backend, dtype, HEAD_DIMS[kind])
    if (kind, dtype) not in _trios:
        _trios[kind, dtype] = cases.build_trio(kind, dtype, "cuda")
    with mla_ops.prefill_backend(backend):
        yield _trios[kind, dtype]


def test_plain_batch(model) -> None:
    cases.check_plain(model, batch=2, length=300)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch(model, side) -> None:
    cases.check_padded(model, side, lengths=(300, 77, 190), total=300)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_kv_cache_steps(model, padded) -> None:
    cases.check_cached_steps(model, steps=(200, 1, 17, 1, 64), lengths=(200, 50, 129) if padded else None)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate(model, cache) -> None:
    cases.check_generate(model, lengths=(40, 17), new_tokens=8, cache_implementation=cache)


@pytest.mark.parametrize("backend", [None, *BACKENDS], ids=lambda b: b or "automatic")
def test_generate_compiled_with_cuda_graphs(backend) -> None:
    """generate() with a static cache compiles its decode steps (mode="reduce-overhead": CUDA-graph
    trees). The integration's calls inside the trees run the best backend that reads the offsets on the
    device, so automatic selection (FLASHINFER first on SM90) and a forced TRITON or FLASH_ATTN replay
    correctly; a forced FLASHINFER, which plans on the host, is refused, never replaced."""
    if backend is not None:
        _require(backend, torch.bfloat16, HEAD_DIMS["deepseek"])
    t = cases.build_trio("deepseek", torch.bfloat16, "cuda")
    torch._dynamo.reset()
    with mla_ops.prefill_backend(backend) if backend else contextlib.nullcontext():
        if backend == "FLASHINFER":
            with pytest.raises(ValueError, match="FLASHINFER cannot run inside CUDA-graph trees"):
                cases.check_generate(t, lengths=(40, 17), new_tokens=6, cache_implementation="static", compile=True)
        else:
            cases.check_generate(t, lengths=(40, 17), new_tokens=6, cache_implementation="static", compile=True)


@pytest.mark.parametrize("with_cu_seq_lens", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_sequences(model, with_cu_seq_lens) -> None:
    cases.check_packed(model, lengths=(130, 1, 257, 33), with_cu_seq_lens=with_cu_seq_lens)


# --- the attention function alone ------------------------------------------------------------------------


def _padded_call(backend: str, dtype: torch.dtype, heads: int = 16, kv_heads: int = 16):
    """A padded batch with a cached prefix: left padding, a gap, padding among the queries."""
    dqk, dv = (192, 128) if heads == kv_heads else (128, 128)
    _require(backend, dtype, (dqk, dv))
    q, k, v = cases.random_qkv(3, heads, kv_heads, 37, 300, dqk, dv, dtype, "cuda")
    mask = torch.ones(3, 300, dtype=torch.bool, device="cuda")
    mask[0, :100] = False
    mask[1, 20:90] = False
    mask[2, -5:] = False
    return q, k, v, mask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (16, 4)], ids=["mla", "gqa"])
def test_attention_function_against_sdpa(backend, dtype, heads, kv_heads) -> None:
    from mla_ops.integrations.transformers import mla_ops_attention_forward

    q, k, v, mask = _padded_call(backend, dtype, heads, kv_heads)
    with mla_ops.prefill_backend(backend):
        out, _ = mla_ops_attention_forward(torch.nn.Module(), q, k, v, mask)
    cases.assert_attention_close_to_sdpa(out, q, k, v, mask, dtype=dtype)
    padding = ~mask[:, -q.shape[2] :]
    assert torch.equal(out[padding], torch.zeros_like(out[padding])), "padding positions must be 0"


@pytest.mark.parametrize("backend", ["TRITON"])
def test_eager_call_reads_nothing_back_to_the_host(backend) -> None:
    """TRITON reads the offsets on the device, so a whole eager call runs under sync-debug "error":
    the layout (partition, offsets, gathers) and the unpacking must not synchronise either."""
    from mla_ops.integrations import transformers as integration

    q, k, v, mask = _padded_call(backend, torch.bfloat16)
    cu = torch.tensor([0, 40, 41, 111], dtype=torch.int32, device="cuda")
    calls = {
        "padded with prefix": ((q, k, v, mask), {}),
        "plain with prefix": ((q, k, v, None), {}),
        "cu_seq_lens": ((q, k[:, :, :37], v[:, :, :37], None), dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu)),
    }
    with mla_ops.prefill_backend(backend):
        for args, kwargs in calls.values():  # compiles the Triton kernels, which may synchronise
            integration.mla_ops_attention_forward(torch.nn.Module(), *args, **kwargs)
        integration.LAYOUTS.clear()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for args, kwargs in calls.values():
                integration.mla_ops_attention_forward(torch.nn.Module(), *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_function_compiles_fullgraph(backend) -> None:
    """Inductor with fullgraph=True (any graph break fails): a padded batch with a cached prefix, and
    packed sequences found through position_ids (traced, so with the one-sequence-per-token bound)."""
    from mla_ops.integrations.transformers import mla_ops_attention_forward

    q, k, v, mask = _padded_call(backend, torch.bfloat16)
    q_new, k_new, v_new = q, k[:, :, -37:], v[:, :, -37:]
    positions = torch.cat([torch.arange(n, device="cuda") for n in (10, 1, 26)]).expand(3, -1)
    segments = torch.tensor([0] * 10 + [1] + [2] * 26, device="cuda").expand(3, -1)
    module = torch.nn.Module()
    torch._dynamo.reset()
    compiled = torch.compile(mla_ops_attention_forward, fullgraph=True)
    with mla_ops.prefill_backend(backend):
        out, _ = compiled(module, q, k, v, mask)
        cases.assert_attention_close_to_sdpa(out, q, k, v, mask)
        out, _ = compiled(module, q_new, k_new, v_new, None, position_ids=positions)
        cases.assert_attention_close_to_sdpa(out, q_new, k_new, v_new, segments=segments)
