"""attn_implementation="mla_ops" in transformers models, on CPU (the REFERENCE backend).

The model cases live in ``tests/transformers_cases.py`` (shared with ``test_gpu_transformers.py``);
this file runs them on CPU and tests the registration, the errors, the per-forward layout reuse and
torch.compile.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import sys

import pytest
import torch
import transformers_cases as cases
from transformers_cases import needs_transformers

DTYPES = [torch.bfloat16, torch.float16]
KINDS = ["deepseek", "llama"]


def test_import_without_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    monkeypatch.delitem(sys.modules, "mla_ops.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'mla_ops\[transformers\]'"):
        importlib.import_module("mla_ops.integrations.transformers")


_trios: dict[tuple[str, torch.dtype], cases.Trio] = {}


def trio(kind: str, dtype: torch.dtype) -> cases.Trio:
    if (kind, dtype) not in _trios:
        _trios[kind, dtype] = cases.build_trio(kind, dtype, "cpu")
    return _trios[kind, dtype]


@pytest.fixture(params=list(itertools.product(KINDS, DTYPES)), ids=lambda p: f"{p[0]}-{str(p[1])[6:]}")
def model(request) -> cases.Trio:
    """Each tiny model (DeepSeek-V3 MLA heads, Llama GQA heads) in bf16 and in fp16."""
    if not cases.HAS_TRANSFORMERS:
        pytest.skip(cases.SKIP_REASON)
    return trio(*request.param)


# --- the cases, against sdpa --------------------------------------------------------------------------


def test_plain_batch(model) -> None:
    cases.check_plain(model)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("positions", ["generate", "model"])
def test_padded_batch(model, side, positions) -> None:
    cases.check_padded(model, side, positions=positions)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_kv_cache_steps(model, padded) -> None:
    cases.check_cached_steps(model, lengths=(7, 4, 5) if padded else None)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate(model, cache) -> None:
    cases.check_generate(model, cache_implementation=cache)


@pytest.mark.parametrize("with_cu_seq_lens", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_sequences(model, with_cu_seq_lens) -> None:
    cases.check_packed(model, with_cu_seq_lens=with_cu_seq_lens)


@needs_transformers
def test_the_comparison_catches_wrong_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cases above can fail: bidirectional attention, or a mask function that drops the padding
    mask, push the logits far past the tolerance. (Left padding is what a dropped mask breaks; with
    generate()'s position ids the padding would look like packed one-token sequences and be harmless.)"""
    from mla_ops.integrations import transformers as integration

    t = cases.build_trio("deepseek", torch.bfloat16, "cpu")
    for layer in t.mla.model.layers:
        layer.self_attn.is_causal = False
    with pytest.raises(AssertionError, match="differ from float32 sdpa"):
        cases.check_plain(t)
    for layer in t.mla.model.layers:
        layer.self_attn.is_causal = True
    cases.check_plain(t)
    monkeypatch.setitem(integration.AttentionMaskInterface._global_mapping, "mla_ops", lambda **kwargs: None)
    with pytest.raises(AssertionError, match="differ from float32 sdpa"):
        cases.check_padded(t, "left", positions="model")


# --- registration -------------------------------------------------------------------------------------


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls that reach the registered attention function."""
    from mla_ops.integrations import transformers as integration

    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return integration.mla_ops_attention_forward(*args, **kwargs)

    monkeypatch.setitem(integration.AttentionInterface._global_mapping, "mla_ops", counting)
    return calls


@needs_transformers
def test_set_attn_implementation_switches_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    t = trio("deepseek", torch.bfloat16)
    model = copy.deepcopy(t.low)
    assert model.config._attn_implementation == "sdpa"
    ids = cases.random_ids(2, 9, "cpu")
    calls = _count_calls(monkeypatch)
    with torch.no_grad():
        model.set_attn_implementation("mla_ops")
        assert model.config._attn_implementation == "mla_ops"
        got = model(ids).logits
        assert calls[0] == model.config.num_hidden_layers
        assert torch.equal(got, t.mla(ids).logits)
        model.set_attn_implementation("sdpa")
        calls[0] = 0
        assert torch.equal(model(ids).logits, t.low(ids).logits)
        assert calls[0] == 0


@needs_transformers
def test_from_pretrained(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    t = trio("deepseek", torch.bfloat16)
    t.low.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="mla_ops", dtype=torch.bfloat16)
    assert model.config._attn_implementation == "mla_ops"
    ids = cases.random_ids(2, 9, "cpu")
    calls = _count_calls(monkeypatch)
    with torch.no_grad():
        got = model.eval()(ids).logits
        assert calls[0] == model.config.num_hidden_layers
        assert torch.equal(got, t.mla(ids).logits)


# --- the attention function alone ---------------------------------------------------------------------


@needs_transformers
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize(
    "heads,kv_heads,dqk,dv", [(4, 4, 192, 128), (4, 2, 64, 64), (4, 1, 96, 32)], ids=["mla", "gqa", "mqa"]
)
def test_attention_function_against_sdpa(causal, heads, kv_heads, dqk, dv) -> None:
    """Padding on both sides and a cached prefix, for MLA, GQA and MQA heads, causal and not."""
    from mla_ops.integrations.transformers import mla_ops_attention_forward

    module = torch.nn.Module()
    q_len, kv_len, scale = 5, 12, 0.11
    mask = torch.ones(3, kv_len, dtype=torch.bool)
    mask[0, :4] = False  # left padding in the prefix
    mask[1, 2:6] = False  # a gap: padding between the prompt and later tokens
    mask[2, -2:] = False  # padding among the queries
    q, k, v = cases.random_qkv(3, heads, kv_heads, q_len, kv_len, dqk, dv, torch.bfloat16)
    out, weights = mla_ops_attention_forward(module, q, k, v, mask, scaling=scale, is_causal=causal)
    assert weights is None and out.shape == (3, q_len, heads, dv) and out.dtype == torch.bfloat16
    cases.assert_attention_close_to_sdpa(out, q, k, v, mask, causal, scale)
    padding = ~mask[:, -q_len:]
    assert torch.equal(out[padding], torch.zeros_like(out[padding])), "padding positions must be 0"


@needs_transformers
def test_static_cache_mask_shorter_than_keys() -> None:
    """Keys past the mask's length (a static cache's empty slots) are ignored, whatever they hold."""
    from mla_ops.integrations.transformers import mla_ops_attention_forward

    q, k, v = cases.random_qkv(2, 2, 2, 3, 10, 64, 64, torch.bfloat16)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :2] = False
    out, _ = mla_ops_attention_forward(torch.nn.Module(), q, k, v, mask)
    k_garbage, v_garbage = k.clone(), v.clone()
    k_garbage[:, :, 7:], v_garbage[:, :, 7:] = 1e4, float("nan")
    again, _ = mla_ops_attention_forward(torch.nn.Module(), q, k_garbage, v_garbage, mask)
    assert torch.equal(out, again)
    cases.assert_attention_close_to_sdpa(out, q, k[:, :, :7], v[:, :, :7], mask)


# --- layout reuse ---------------------------------------------------------------------------------------


@pytest.fixture
def layout_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``[n]``: how many layouts the integration's layout cache has built since the test began (it starts
    empty)."""
    from mla_ops.integrations.transformers import LAYOUTS

    built = [0]
    build = LAYOUTS.build

    def counting(*args, **kwargs):
        built[0] += 1
        return build(*args, **kwargs)

    LAYOUTS.clear()
    monkeypatch.setattr(LAYOUTS, "build", counting)
    return built


@needs_transformers
def test_layout_is_built_once_per_forward(layout_builds: list[int]) -> None:
    t = trio("deepseek", torch.bfloat16)
    built = layout_builds
    ids = cases.random_ids(2, 9, "cpu")
    mask = cases.padding_mask([9, 5], 9, "left", "cpu")
    with torch.no_grad():
        first = t.mla(ids, attention_mask=mask).logits
        assert built[0] == 1, "every layer of one forward pass shares one layout"
        assert torch.equal(t.mla(ids, attention_mask=mask).logits, first)
        assert built[0] == 2, "the model makes a new mask tensor each pass"
        mask[0, :3] = 0  # in place: the version counter changes, so the layout is rebuilt
        changed = t.mla(ids, attention_mask=mask).logits
    assert built[0] == 3
    assert not torch.equal(changed[0, 3:], first[0, 3:])


@needs_transformers
def test_layout_is_not_cached_for_inference_mode_tensors(layout_builds: list[int]) -> None:
    t = trio("deepseek", torch.bfloat16)
    built = layout_builds
    with torch.inference_mode():
        ids = cases.random_ids(2, 9, "cpu")
        mask = cases.padding_mask([9, 5], 9, "left", "cpu")
        t.mla(ids, attention_mask=mask)
    assert built[0] == t.mla.config.num_hidden_layers


# --- errors -----------------------------------------------------------------------------------------------


@needs_transformers
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dropout=0.1), "attention dropout"),
        (dict(sliding_window=4), "sliding-window"),
        (dict(softcap=30.0), "soft-capping"),
        (dict(s_aux=torch.zeros(2)), "sinks"),
        (dict(position_bias=torch.zeros(1)), "position bias"),
    ],
)
def test_unsupported_features_raise(kwargs, match) -> None:
    from mla_ops.integrations.transformers import mla_ops_attention_forward

    q, k, v = cases.random_qkv(1, 2, 2, 4, 4, 64, 64, torch.bfloat16)
    with pytest.raises(NotImplementedError, match=match + ".*attn_implementation='sdpa'"):
        mla_ops_attention_forward(torch.nn.Module(), q, k, v, None, **kwargs)


@needs_transformers
def test_bad_inputs_raise() -> None:
    from mla_ops.integrations.transformers import mla_ops_attention_forward as attn

    module = torch.nn.Module()
    q, k, v = cases.random_qkv(1, 3, 2, 4, 4, 64, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="3 query heads cannot share 2"):
        attn(module, q, k, v, None)
    q, k, v = cases.random_qkv(1, 2, 2, 4, 4, 64, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="2-D padding mask"):
        attn(module, q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="4 queries but only 3 keys"):
        attn(module, q, k[:, :, :3], v[:, :, :3], None)
    with pytest.raises(TypeError, match=r"dtype=torch\.bfloat16"):
        attn(module, q.float(), k.float(), v.float(), None)
    with pytest.raises(NotImplementedError, match="cu_seq_lens_q/cu_seq_lens_k"):
        cu = torch.tensor([0, 2, 3], dtype=torch.int32)
        attn(module, q[:, :, :3], k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(RuntimeError, match="forward-only"):
        attn(module, q.requires_grad_(), k, v, None)


@needs_transformers
def test_float32_runs_under_autocast() -> None:
    from mla_ops.integrations.transformers import mla_ops_attention_forward

    q, k, v = cases.random_qkv(1, 2, 2, 4, 4, 64, 64, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = mla_ops_attention_forward(torch.nn.Module(), q, k, v, None)
    assert out.dtype == torch.bfloat16
    cases.assert_attention_close_to_sdpa(out, q, k, v)


@needs_transformers
def test_mask_function_refuses_what_it_cannot_express() -> None:
    from mla_ops.integrations.transformers import mla_ops_mask

    mask = torch.ones(2, 6, dtype=torch.bool)
    assert torch.equal(mla_ops_mask(2, 6, 6, attention_mask=mask), mask)
    assert mla_ops_mask(2, 2, 6, q_offset=4, attention_mask=torch.ones(2, 9, dtype=torch.bool)).shape == (2, 6)
    assert mla_ops_mask(2, 2, 6, q_offset=4) is None  # a dynamic cache: every key slot holds a token
    with pytest.raises(NotImplementedError, match="custom mask pattern"):
        mla_ops_mask(2, 6, 6, use_vmap=True)
    with pytest.raises(ValueError, match="needs the 2-D attention_mask"):
        mla_ops_mask(2, 1, 16, q_offset=torch.tensor(4))  # a static cache without a mask


# --- torch.compile ------------------------------------------------------------------------------------------


def _compile_inputs():
    q, k, v = cases.random_qkv(2, 4, 2, 6, 10, 64, 64, torch.bfloat16)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :3] = False
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    cu = torch.tensor([0, 4, 9, 12], dtype=torch.int32)
    return {
        "plain": ((q, k[:, :, :6], v[:, :, :6], None), {}),
        "cached prefix": ((q, k, v, None), {}),
        "padded with prefix": ((q, k, v, mask), {}),
        "packed position_ids": ((q, k[:, :, :6], v[:, :, :6], None), dict(position_ids=positions)),
        "cu_seq_lens": (
            (q, k[:, :, :6], v[:, :, :6], None),
            dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5),
        ),
    }


@needs_transformers
@pytest.mark.parametrize("case", list(_compile_inputs()))
def test_attention_function_compiles_without_graph_breaks(case) -> None:
    """fullgraph=True fails on any graph break; the traced layout (no host read) must give the eager result."""
    from mla_ops.integrations.transformers import mla_ops_attention_forward

    args, kwargs = _compile_inputs()[case]
    module = torch.nn.Module()
    torch._dynamo.reset()
    compiled = torch.compile(mla_ops_attention_forward, fullgraph=True, backend="aot_eager")
    eager, _ = mla_ops_attention_forward(module, *args, **kwargs)
    traced, _ = compiled(module, *args, **kwargs)
    torch.testing.assert_close(traced, eager, atol=0, rtol=0)


@needs_transformers
def test_compiled_model_has_no_graph_break_in_the_attention_function() -> None:
    """A decode step of a padded batch over a KV cache, under torch.compile(fullgraph=False):
    transformers' own code may break the graph, the attention function must not, and every layer's
    three ops must be in the captured graphs."""
    from transformers import DynamicCache

    from mla_ops.integrations import transformers as integration

    t = trio("deepseek", torch.bfloat16)
    ids = cases.random_ids(2, 9, "cpu")
    mask = cases.padding_mask([9, 5], 9, "left", "cpu")
    with torch.no_grad():
        cache, name = DynamicCache(config=t.mla.config), cases.cache_argument(t.mla)
        t.mla(ids[:, :6], attention_mask=mask[:, :6], use_cache=True, **{name: cache})

        def step(model):
            return model(ids[:, 6:], attention_mask=mask, use_cache=True, **{name: copy.deepcopy(cache)}).logits

        torch._dynamo.reset()
        explanation = torch._dynamo.explain(step)(t.mla)
        ours = [
            reason
            for reason in explanation.break_reasons
            if any(frame.filename == integration.__file__ for frame in reason.user_stack)
        ]
        assert not ours, [reason.reason for reason in ours]
        traced = [str(node.target) for graph in explanation.graphs for node in graph.graph.nodes]
        for op in ("mla.prefill", "mla.prefill_context_chunk", "mla.merge_attn_states"):
            assert traced.count(op) == t.mla.config.num_hidden_layers, (op, traced.count(op))
        torch._dynamo.reset()
        got = torch.compile(step, backend="eager")(t.mla)
        want = step(t.mla)
    assert torch.equal(got, want)


@needs_transformers
def test_static_cache_decode_compiles_once_with_dynamic_shapes() -> None:
    """Decode steps over a static cache: the mask grows by one each step while the keys keep the
    cache's length. With dynamic shapes one graph serves every step (no recompile, no graph break)."""
    from mla_ops.integrations.transformers import mla_ops_attention_forward

    q, k, v = cases.random_qkv(2, 4, 2, 1, 16, 64, 64, torch.bfloat16)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, :3] = False
    module = torch.nn.Module()
    torch._dynamo.reset()
    compiled = torch.compile(mla_ops_attention_forward, fullgraph=True, dynamic=True, backend="aot_eager")
    for step, length in enumerate(range(6, 10)):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            got, _ = compiled(module, q, k, v, mask[:, :length])
        want, _ = mla_ops_attention_forward(module, q, k, v, mask[:, :length])
        torch.testing.assert_close(got, want, atol=0, rtol=0)
