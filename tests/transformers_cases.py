"""The transformers integration's test cases, shared by the CPU and GPU test files.

Each case runs one model three times on the same weights and inputs: with ``attn_implementation``
``"mla_ops"`` in a low dtype (bf16 or fp16), with ``"sdpa"`` in that dtype, and with ``"sdpa"`` in
float32. In the style of flash-attention's tests, the mla_ops run may err against the float32 run by
at most twice what the low-dtype sdpa run errs, plus one ulp of the low dtype at the output's scale.
Only real tokens are compared: what a model computes at padding positions is meaningless.

transformers is imported lazily, so that this module imports (and the tests that use it skip with a
reason) when it is not installed.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
SKIP_REASON = "transformers is not installed: pip install 'mla_ops[transformers]'"
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason=SKIP_REASON)

VOCAB = 128
FACTOR = 2.0

#: What both tiny models share. A large initializer range makes attention peaked, so that a wrong mask
#: or a wrong layout changes the logits far beyond the tolerance.
TINY = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=512, initializer_range=0.2)

#: A tiny DeepSeek-V3 with the real MLA head dims (q/k 128 + 64 = 192, v 128) and dense MLPs only
#: (first_k_dense_replace covers every layer).
DEEPSEEK = dict(
    TINY,
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    first_k_dense_replace=2,
)

#: A tiny Llama with grouped-query attention (4 query heads over 2 key/value heads) and equal head
#: dims (64, 64).
LLAMA = dict(TINY, hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def make_config(kind: str, **overrides: object):
    """A fresh config of the tiny ``"deepseek"`` or ``"llama"`` model."""
    from transformers import DeepseekV3Config, LlamaConfig

    cls, base = {"deepseek": (DeepseekV3Config, DEEPSEEK), "llama": (LlamaConfig, LLAMA)}[kind]
    return cls(**{**base, **overrides})


@dataclass
class Trio:
    """One model's weights as ``mla`` (mla_ops, low dtype), ``low`` (sdpa, same dtype), ``ref`` (sdpa, fp32)."""

    mla: torch.nn.Module
    low: torch.nn.Module
    ref: torch.nn.Module
    dtype: torch.dtype
    device: torch.device


def build_trio(kind: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> Trio:
    from transformers import AutoModelForCausalLM

    import mla_ops.integrations.transformers  # noqa: F401  (registers "mla_ops")

    config = make_config(kind)
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float32)

    def like(impl: str) -> torch.nn.Module:
        # Each model gets its own config: from_config records the implementation on the config object.
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl, dtype=dtype)
        model.load_state_dict(ref.state_dict())
        return model.to(device).eval()

    return Trio(like("mla_ops"), like("sdpa"), ref.to(device).eval(), dtype, torch.device(device))


def assert_close_to_reference(
    outputs: Sequence[torch.Tensor], dtype: torch.dtype, valid: torch.Tensor | None, what: str
) -> None:
    """``outputs`` is ``(mla, low, ref)``: ``|mla - ref| <= FACTOR * |low - ref| + ulp``, maxima over the
    ``valid`` positions (all when ``None``), with the ulp of ``dtype`` at the reference's scale."""
    out, low, ref = outputs
    ulp = torch.finfo(dtype).eps
    if valid is not None:
        out, low, ref = out[valid], low[valid], ref[valid]
    out, low, ref = out.float(), low.float(), ref.float()
    assert torch.isfinite(out).all(), f"mla_ops {what} hold NaN or inf"
    err = (out - ref).abs().max().item()
    bound = FACTOR * (low - ref).abs().max().item() + ulp * ref.abs().max().item()
    assert err <= bound, f"mla_ops {what} differ from float32 sdpa by {err:.3e}, more than {bound:.3e}"


def random_ids(batch: int, length: int, device: torch.device | str, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=gen).to(device)


def padding_mask(lengths: Sequence[int], total: int, side: str, device: torch.device | str) -> torch.Tensor:
    """int64 ``[B, total]`` mask with ``lengths[b]`` real tokens, padded on the ``"left"`` or ``"right"``."""
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "left":
            mask[b, total - n :] = 1
        else:
            mask[b, :n] = 1
    return mask.to(device)


def generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as ``generate()`` derives them from a padding mask."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


@torch.no_grad()
def forward_all(trio: Trio, **inputs: object) -> list[torch.Tensor]:
    """The logits of the three models for the same inputs."""
    return [model(**inputs).logits for model in (trio.mla, trio.low, trio.ref)]


# --- the cases --------------------------------------------------------------------------------------


def check_plain(trio: Trio, batch: int = 2, length: int = 13) -> None:
    """A batch without a mask (one sequence per row)."""
    ids = random_ids(batch, length, trio.device)
    assert_close_to_reference(forward_all(trio, input_ids=ids), trio.dtype, None, "logits")


def check_padded(
    trio: Trio, side: str, lengths: Sequence[int] = (13, 6, 9), total: int = 13, positions: str = "generate"
) -> None:
    """A padded batch with a 2-D mask; every row has a different number of padding tokens.

    ``positions``: ``"generate"`` numbers the real tokens from 0 as ``generate()`` does, ``"model"``
    lets the model number every position from 0.
    """
    ids = random_ids(len(lengths), total, trio.device)
    mask = padding_mask(lengths, total, side, trio.device)
    position_ids = generate_positions(mask) if positions == "generate" else None
    logits = forward_all(trio, input_ids=ids, attention_mask=mask, position_ids=position_ids)
    assert_close_to_reference(logits, trio.dtype, mask.bool(), f"{side}-padded logits")


def cache_argument(model: torch.nn.Module) -> str:
    """The forward argument that takes a KV cache: ``past_key_values``, renamed ``cache`` in later 5.x."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def _cached_steps(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, steps: Sequence[int]):
    """Run ``ids`` through ``model`` in steps of the given sizes over one KV cache; ``mask`` ``None``
    passes no mask (the model numbers the positions itself)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    positions = None if mask is None else generate_positions(mask)
    start, logits = 0, []
    for n in steps:
        end = start + n
        out = model(
            input_ids=ids[:, start:end],
            attention_mask=None if mask is None else mask[:, :end],
            position_ids=None if positions is None else positions[:, start:end],
            use_cache=True,
            **{cache_argument(model): cache},
        )
        logits.append(out.logits)
        start = end
    return logits


def check_cached_steps(
    trio: Trio, steps: Sequence[int] = (7, 1, 3, 1, 2), lengths: Sequence[int] | None = (7, 4, 5), side: str = "left"
) -> None:
    """Prefill, then decode steps of one and of several tokens over a KV cache, with a batch padded on
    ``side`` to the ``lengths`` of its prompts (``None``: two rows, no padding and no mask)."""
    prompt = steps[0]
    total = sum(steps)
    ids = random_ids(2 if lengths is None else len(lengths), total, trio.device, seed=2)
    mask = None
    if lengths is not None:
        mask = torch.cat([padding_mask(lengths, prompt, side, trio.device), torch.ones_like(ids[:, prompt:])], 1)
    runs = [_cached_steps(model, ids, mask, steps) for model in (trio.mla, trio.low, trio.ref)]
    start = 0
    for i, n in enumerate(steps):
        step_mask = None if mask is None else mask[:, start : start + n].bool()
        assert_close_to_reference([run[i] for run in runs], trio.dtype, step_mask, f"logits of step {i} ({n} tokens)")
        start += n


def check_generate(
    trio: Trio,
    lengths: Sequence[int] = (6, 3),
    new_tokens: int = 5,
    cache_implementation: str = "dynamic",
    compile: bool = False,
) -> None:
    """``generate()`` over a left-padded batch: its logits at every step, against the same steps run
    through the fp32 and low-dtype sdpa models on the tokens mla_ops generated. A ``"static"`` cache
    hands the attention function keys longer than the mask (its empty slots); on CUDA, ``generate()``
    compiles the decode steps with CUDA graphs for such a cache unless ``compile`` is false."""
    prompt = max(lengths)
    ids = random_ids(len(lengths), prompt, trio.device, seed=3)
    mask = padding_mask(lengths, prompt, "left", trio.device)
    with torch.no_grad():
        out = trio.mla.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            cache_implementation=cache_implementation,
            disable_compile=not compile,
        )
    assert out.sequences.shape == (len(lengths), prompt + new_tokens)
    generated = torch.stack(out.logits, 1)  # [B, new_tokens, V], as the model produced them
    chosen = torch.stack(out.scores, 1).argmax(-1)  # after the processors (min_new_tokens masks EOS)
    assert torch.equal(chosen, out.sequences[:, prompt:]), "greedy decoding must pick the best score"
    full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, prompt:])], 1)
    steps = [prompt] + [1] * (new_tokens - 1)
    references = []
    for model in (trio.low, trio.ref):
        logits = _cached_steps(model, out.sequences, full_mask, steps)
        references.append(torch.stack([step[:, -1] for step in logits], 1))
    assert_close_to_reference([generated, *references], trio.dtype, None, "generate() logits")


def packed_positions(lengths: Sequence[int], device: torch.device | str) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)


def check_packed(trio: Trio, lengths: Sequence[int] = (5, 1, 8, 3), with_cu_seq_lens: bool = False) -> None:
    """Several sequences in one row, told apart by ``position_ids`` restarting at 0 (and, optionally,
    by ``cu_seq_lens_q/k`` + ``max_length_q/k`` as FlashAttention's data collator passes them). The
    sdpa runs build their packed mask from the same ``position_ids`` (without a cache)."""
    total = sum(lengths)
    ids = random_ids(1, total, trio.device, seed=4)
    inputs: dict[str, object] = dict(input_ids=ids, position_ids=packed_positions(lengths, trio.device))
    if with_cu_seq_lens:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=trio.device)
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    logits = forward_all(trio, use_cache=False, **inputs)
    assert_close_to_reference(logits, trio.dtype, None, "packed logits")


# --- the attention function alone ---------------------------------------------------------------------


def random_qkv(
    batch: int,
    heads: int,
    kv_heads: int,
    q_len: int,
    kv_len: int,
    dqk: int,
    dv: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``query`` ``[B, H, Sq, Dqk]``, ``key`` ``[B, Hkv, Sk, Dqk]``, ``value`` ``[B, Hkv, Sk, Dv]`` as
    transformers passes them; scaled up so that attention is peaked."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return (2 * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype)

    return randn(batch, heads, q_len, dqk), randn(batch, kv_heads, kv_len, dqk), randn(batch, kv_heads, kv_len, dv)


def sdpa_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention as transformers' sdpa path computes it: GQA heads repeated, the queries at the end of
    the keys, a 2-D padding mask over the keys, and, for packed sequences (``Sq == Sk``), ``segments``
    ``[B, S]``: a token sees only the tokens of its own segment. Returns ``[B, Sq, H, Dv]``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    q_len, kv_len = q.shape[2], k.shape[2]
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril(kv_len - q_len)
    allowed = allowed[None, None]
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]
    if segments is not None:
        allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return out.transpose(1, 2)


def assert_attention_close_to_sdpa(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    dtype: torch.dtype = torch.bfloat16,
    segments: torch.Tensor | None = None,
) -> None:
    """The attention function's output ``[B, Sq, H, Dv]`` against sdpa in float32, with sdpa in
    ``dtype`` setting the bound; only the real query tokens (the mask's last ``Sq`` columns) count."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    ref = sdpa_reference(q.float(), k.float(), v.float(), mask, causal, scale, segments)
    low = sdpa_reference(q.to(dtype), k.to(dtype), v.to(dtype), mask, causal, scale, segments)
    valid = None if mask is None else mask.bool()[:, -q.shape[2] :]
    assert_close_to_reference([out, low, ref], dtype, valid, "attention output")
