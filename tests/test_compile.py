"""torch.compile(fullgraph=True) over the ops and over the MLA layer, with graph breaks and
recompiles counted, and across size classes of a size-aware route. On CPU the ops run REFERENCE;
tests/test_gpu_e2e.py repeats this on CUDA."""

from __future__ import annotations

import pytest
import standins
import torch
import torch._dynamo
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from utils import assert_attention_close, cu_seqlens_of, make_batch, make_qkv, reset_compile

import mla_ops
from mla_ops import DeviceCapability, cost_table, selector
from mla_ops.backends.flash_attn import FlashAttnBackend
from mla_ops.backends.reference import ReferenceBackend
from mla_ops.cost_table import SizeClass
from mla_ops.model import MLAAttention, MLAConfig, pack_context, random_batch

# Five ragged batches with different token counts and batch sizes, each with two context chunks.
# Dynamo specialises sizes 0 and 1, so no tensor here is 0 or 1 tokens long (individual sequences
# may be): a 1-token chunk tensor in one batch would cost a recompile when the next one is longer.
# The first two batches differ in every size and int, so automatic dynamic shapes mark all of them
# dynamic at the first recompile.
BATCHES = [
    ([5, 0, 9], [[2, 0, 3], [2, 0, 1]]),
    ([12, 1], [[4, 4], [0, 4]]),
    ([3, 3, 3, 3], [[1, 2, 3, 4], [0, 0, 2, 1]]),
    ([20], [[7], [7]]),
    ([1, 6, 0, 2, 8], [[0, 1, 2, 3, 4], [5, 0, 0, 0, 0]]),
]


def _inputs(lengths, context, seed):
    b = make_batch(lengths, 2, 192, 128, torch.bfloat16, strided_v=True, seed=seed)
    chunks = []
    for i, ctx in enumerate(context):
        _, k, v = make_qkv(sum(ctx), 2, 192, 128, torch.bfloat16, generator=torch.Generator().manual_seed(seed + i))
        chunks.append(mla_ops.ContextChunk(k, v, cu_seqlens_of(ctx), max(ctx)))
    return b, chunks


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _compiled_variants(fn) -> int:
    """How many graphs dynamo keeps for ``fn``'s code: 1 + the number of recompiles.

    (Counting backend calls would also count dynamo's internal restarts of one compile.)
    """
    return len(_debug_get_cache_entry_list(fn.__code__))


def _run_batches(mark_dynamic: bool, dynamic: bool | None = None) -> tuple[int, int]:
    reset_compile()

    def attend(q, k, v, cu, max_seqlen, chunks):
        return mla_ops.prefill_with_context(q, k, v, cu, max_seqlen, chunks)

    compiled = torch.compile(attend, fullgraph=True, dynamic=dynamic)

    for seed, (lengths, context) in enumerate(BATCHES):
        b, chunks = _inputs(lengths, context, seed)
        if mark_dynamic:
            for t in (b.q, b.k, b.v):
                torch._dynamo.mark_dynamic(t, 0)
        out, lse = compiled(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, chunks)
        want_out, want_lse = mla_ops.prefill_with_context(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, chunks)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    return _compiled_variants(attend), _graph_breaks()


def test_prefill_with_context_compiles_once_with_automatic_dynamic_shapes() -> None:
    compiles, breaks = _run_batches(mark_dynamic=False)
    assert breaks == 0
    assert compiles <= 2, f"{compiles - 1} recompiles over {len(BATCHES)} batches"


def test_prefill_with_context_recompiles_at_most_once_with_tokens_marked_dynamic() -> None:
    compiles, breaks = _run_batches(mark_dynamic=True)
    assert breaks == 0
    # The token dims are dynamic from the start; the max_seqlen ints still cost the one recompile.
    assert compiles <= 2, f"{compiles - 1} recompiles over {len(BATCHES)} batches"


def test_prefill_with_context_never_recompiles_when_compiled_dynamic() -> None:
    compiles, breaks = _run_batches(mark_dynamic=False, dynamic=True)
    assert breaks == 0
    assert compiles == 1, f"{compiles - 1} recompiles over {len(BATCHES)} batches"


def test_compiled_graph_calls_the_custom_ops() -> None:
    b, chunks = _inputs(*BATCHES[0], seed=0)
    explanation = torch._dynamo.explain(mla_ops.prefill_with_context)(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, chunks)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    code = "\n".join(g.code for g in explanation.graphs)
    for op in ("mla.prefill", "mla.prefill_context_chunk", "mla.merge_attn_states"):
        assert op in code


def layer_batches(layer: MLAAttention, count: int = 10, chunk_size: int = 8):
    """``count`` ragged batches of different sizes, each with exactly two context chunks."""
    gen = torch.Generator().manual_seed(0)
    for i in range(count):
        num_seqs = 2 + i % 3
        lengths = [3 + (7 * i + 5 * j) % 29 for j in range(num_seqs)]
        context = [(5 * i + 4 * j) % (2 * chunk_size + 1) for j in range(num_seqs)]
        context[0] = chunk_size + 2 + i % (chunk_size - 1)  # two chunks, neither of them 0 or 1 tokens
        batch = random_batch(layer, lengths, context, chunk_size=chunk_size, generator=gen)
        assert len(batch.context) == 2
        yield batch


@torch.no_grad()
def test_mla_layer_compiles_fullgraph_once_across_ten_batches() -> None:
    reset_compile()
    torch.manual_seed(0)
    layer = MLAAttention(MLAConfig(hidden_size=256, num_heads=4, kv_lora_rank=64), dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for batch in layer_batches(layer):
        args = (batch.hidden, batch.positions, batch.cu_seqlens, batch.max_seqlen, batch.context)
        # Inductor fuses the projections' epilogues differently from eager: compare at bf16 precision.
        torch.testing.assert_close(compiled(*args), layer(*args), rtol=2e-2, atol=2e-3)
    assert _graph_breaks() == 0
    variants = _compiled_variants(layer.forward)
    assert variants == 1, f"{variants - 1} recompiles over 10 batches"


# --- one graph for every batch: what PyTorch needs from the user --------------------------------------------------
#
# Under dynamic=True every size is a symbol, and two sizes of the first batch that happen to be equal share one
# ("duck sizing"): a first batch of T = 16 tokens at H = 16 heads (or T = 128 = Dv, T = 192 = Dqk, a packed
# context of 512 rows = kv_lora_rank or of 64 = the rotary dim) compiles a graph that guards on T == H, and the
# next batch recompiles. Sizes 0 and 1 are specialised too: a batch of one token compiles a graph of its own.
# Neither comes from the package's code (the sizes are fixed when Dynamo first sees the inputs, before any of it
# runs), and neither can be undone from inside a compiled function; PyTorch's switches for both are global, so
# the package leaves them to the user, and the README shows these two lines, which the tests below run verbatim.


@pytest.fixture
def one_graph_settings():
    """The README's two lines before torch.compile (restored afterwards); the compile profiles PyTorch keeps
    on disk between processes are left out, so that what is counted is this process's compiles."""
    import torch.fx.experimental._config

    saved = (torch.fx.experimental._config.use_duck_shape, torch.fx.experimental._config.backed_size_oblivious)
    # --- as in the README:
    torch.fx.experimental._config.use_duck_shape = False  # sizes that are equal by chance stay apart
    torch.fx.experimental._config.backed_size_oblivious = True  # and 0 or 1 tokens are not special
    # ---
    try:
        with torch._dynamo.config.patch(automatic_dynamic_local_pgo=False):
            yield
    finally:
        torch.fx.experimental._config.use_duck_shape, torch.fx.experimental._config.backed_size_oblivious = saved


# Batches after the first: ragged, and of one token (H = 16, Dqk = 192, Dv = 128 as DeepSeek-V3 under TP=8).
OP_BATCHES = [[5, 9], [1], [40, 3, 7], [2], [1]]


def _op_graphs(first_tokens: int) -> int:
    reset_compile()

    def attend(q, k, v, cu, max_seqlen):
        return mla_ops.prefill(q, k, v, cu, max_seqlen)

    compiled = torch.compile(attend, fullgraph=True, dynamic=True)
    for seed, lengths in enumerate([[first_tokens], *OP_BATCHES]):
        b = make_batch(lengths, 16, 192, 128, torch.bfloat16, strided_v=True, seed=seed)
        out, lse = compiled(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)
        want_out, want_lse = mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert _graph_breaks() == 0
    return _compiled_variants(attend)


@pytest.mark.parametrize("first_tokens", [16, 128, 192])
def test_op_compiles_once_when_the_first_batch_matches_a_model_dimension(one_graph_settings, first_tokens) -> None:
    graphs = _op_graphs(first_tokens)
    assert graphs == 1, f"{graphs} graphs for a first batch of {first_tokens} tokens and {len(OP_BATCHES)} more"


def test_without_the_settings_pytorch_recompiles_after_a_first_batch_of_h_tokens() -> None:
    # Why the README asks for the two lines: PyTorch's defaults compile more than one graph here. (Should this
    # start to fail, PyTorch no longer needs them, and the README's lines can go.)
    import torch.fx.experimental._config

    defaults = torch.fx.experimental._config.patch(use_duck_shape=True, backed_size_oblivious=False)
    with defaults, torch._dynamo.config.patch(automatic_dynamic_local_pgo=False):
        assert _op_graphs(16) > 1


@pytest.mark.parametrize(
    ("first_new", "first_context"),
    [(7, 512), (7, 64), (1, 10)],
    ids=["context of kv_lora_rank rows", "context of rotary-dim rows", "one token"],
)
@torch.no_grad()
def test_mla_layer_compiles_once_for_any_first_batch(one_graph_settings, first_new, first_context) -> None:
    reset_compile()
    torch.manual_seed(0)
    layer = MLAAttention(MLAConfig(hidden_size=256, num_heads=4, kv_lora_rank=512), dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    plan = [([first_new], [first_context]), ([5, 9], [30, 0]), ([1], [3]), ([40, 3, 7], [0, 0, 300]), ([1], [0])]
    for lengths, context in plan:
        batch = random_batch(layer, lengths, context, chunk_size=256, generator=gen)
        packed = [pack_context(layer, batch.cu_seqlens, batch.context)]
        got = compiled(batch.hidden, batch.positions, batch.cu_seqlens, batch.max_seqlen, packed)
        want = layer(batch.hidden, batch.positions, batch.cu_seqlens, batch.max_seqlen, batch.context)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
    assert _graph_breaks() == 0
    graphs = _compiled_variants(layer.forward)
    assert graphs == 1, f"{graphs} graphs over {len(plan)} batches"


# --- size-aware routing under torch.compile: the choice is made inside the op, at run time -------------------------


class _CountingReference(ReferenceBackend):
    """REFERENCE, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def attention(self, call):
        self.calls += 1
        return super().attention(call)


def test_a_change_of_size_class_neither_recompiles_nor_breaks_the_graph() -> None:
    # A route that a cost table ranks, as a GPU caches it, made the route of CPU tensors: FLASH_ATTN (around the
    # FlashAttention-4 stand-in) for calls of 64 tokens and more, REFERENCE below.
    library = standins.flash_attn_libraries("flash_attn.cute")
    flash_attn, reference = FlashAttnBackend(libraries=library), _CountingReference()
    small, large = SizeClass.of(True, 16, 16, 2, 2, 8, 8), SizeClass.of(True, 128, 128, 2, 2, 64, 64)
    device_us = {small: {"FLASH_ATTN": 1.0, "REFERENCE": 2.0}, large: {"FLASH_ATTN": 9.0, "REFERENCE": 900.0}}
    table = cost_table.CostTable(
        DeviceCapability(9, 0), "Stand-in GPU", {}, "", {"FLASH_ATTN": 50.0, "REFERENCE": 1.0},
        {("bfloat16", 192, 128): device_us},
    )  # fmt: skip
    reset_compile()
    selector._routes[(torch.device("cpu"), torch.bfloat16, 192, 128, False)] = selector.SizedRoute(
        reference, [flash_attn, reference], table, ("bfloat16", 192, 128)
    )

    def attend(q, k, v, cu, max_seqlen):
        return mla_ops.prefill(q, k, v, cu, max_seqlen)

    compiled = torch.compile(attend, fullgraph=True, dynamic=True)
    routed = []
    for lengths in ([5, 9], [40, 60], [3, 8], [64, 50], [7, 6]):
        b = make_batch(lengths, 2, 192, 128, torch.bfloat16, strided_v=True, seed=len(routed))
        before = (len(library["flash_attn.cute"].calls), reference.calls)
        out, lse = compiled(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)
        after = (len(library["flash_attn.cute"].calls), reference.calls)
        routed.append("FLASH_ATTN" if after[0] > before[0] else "REFERENCE" if after[1] > before[1] else "none")
        assert_attention_close(out, lse, b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens, 192**-0.5, True)
    assert routed == ["REFERENCE", "FLASH_ATTN", "REFERENCE", "FLASH_ATTN", "REFERENCE"]
    assert _graph_breaks() == 0
    assert _compiled_variants(attend) == 1, f"{_compiled_variants(attend) - 1} recompiles across size classes"
