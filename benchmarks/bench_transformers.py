#!/usr/bin/env python
"""A DeepSeek-V3-shaped model through Hugging Face transformers: ``attn_implementation="mla_ops"``
against transformers' own ``"sdpa"`` (and its FlashAttention paths where they run), per prefill forward.

The model is a ``DeepseekV3ForCausalLM`` with DeepSeek-V3's attention (hidden 7168, q_lora 1536,
kv_lora 512, heads of 128 + 64 and 128 channels) and ``--heads`` query heads (128 for the full model,
16 per GPU under 8-way tensor parallelism), with random weights, ``--layers`` layers and dense MLPs
made small (``--intermediate``) so that attention is what the figure mostly measures. One forward of
a batch of ``--batch`` sequences of ``--tokens`` total new tokens, no cache, is timed with the
benchmarks' timer (CUDA events, median), for every valid mla_ops backend (forced with
``prefill_backend``) and for each transformers implementation that loads here. Outputs are compared
with the first implementation's logits (``rel diff``). Without a GPU it times a tiny model on CPU (a
test of the script, not a measurement).

Writes ``transformers.csv``, ``transformers.md`` and ``transformers.env.json`` into
``benchmarks/results/<gpu-slug>/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The shared modules live next to this script, which is not part of a package.
from benchlib import cli, timing
from benchlib import methods as M
from benchlib import problems as P
from benchlib import report as R

#: The columns of transformers.csv, and of transformers.md for those with a header.
FIELDS = R.Fields(
    ("heads", "H", "d"),
    ("tokens", "tokens", "d"),
    "batch",
    "layers",
    ("implementation", "implementation"),
    ("backend", "backend"),
    ("forward_ms", "ms / forward", ".3f"),
    ("speedup", "speed-up vs first", ".2f"),
    ("rel_diff", "rel diff", ".1e"),
    ("note", "note"),
)
#: transformers' own attention implementations compared against, in order; the first that loads is
#: the reference of ``rel diff`` and ``speedup``.
HF_IMPLEMENTATIONS = ["sdpa", "flash_attention_4", "flash_attention_2"]
GPU_DEFAULTS = {"heads": "16,128", "tokens": "4096,16384", "layers": 2, "batch": 4, "intermediate": 1024}
CPU_DEFAULTS = {"heads": "2", "tokens": "64", "layers": 1, "batch": 2, "intermediate": 64}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__.split("\n\n")[0] + " Defaults differ on CPU (a tiny model).")
    parser.add_argument("--heads", help=f"comma-separated query head counts (default {GPU_DEFAULTS['heads']})")
    parser.add_argument("--tokens", help=f"comma-separated new-token totals (default {GPU_DEFAULTS['tokens']})")
    parser.add_argument("--batch", type=int, help=f"sequences per batch (default {GPU_DEFAULTS['batch']})")
    parser.add_argument("--layers", type=int, help=f"decoder layers (default {GPU_DEFAULTS['layers']})")
    parser.add_argument("--intermediate", type=int, help="dense MLP width (default 1024: small, attention dominates)")
    cli.add_backends(parser, help="mla_ops backends (default: all valid here)")
    cli.add_timer(parser)
    cli.add_out_dir(parser)
    cli.add_device(parser)
    return parser.parse_args(argv)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--{what} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise SystemExit(f"--{what} must be positive, got {text!r}")
    return values


def build_model(heads: int, args: argparse.Namespace, device: Any, dtype: Any) -> Any:
    """A random DeepSeek-V3-shaped causal LM with ``heads`` query heads."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cpu = device.type != "cuda"
    config = DeepseekV3Config(
        vocab_size=1024,
        hidden_size=256 if cpu else 7168,
        intermediate_size=args.intermediate,
        moe_intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        first_k_dense_replace=args.layers,  # dense MLPs only
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=None if cpu else 1536,
        kv_lora_rank=64 if cpu else 512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=max(args.token_counts) + 16,
        initializer_range=0.02,
    )
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device, dtype = P.setup_device(args, GPU_DEFAULTS, CPU_DEFAULTS)
    try:
        import transformers
    except ImportError:
        print("bench_transformers.py needs transformers: pip install 'mla_ops[transformers]'", file=sys.stderr)
        return 2
    import torch

    import mla_ops
    import mla_ops.integrations.transformers

    args.head_counts, args.token_counts = _ints(args.heads, "heads"), _ints(args.tokens, "tokens")
    if args.batch < 1 or args.layers < 1:
        raise SystemExit("--batch and --layers must be at least 1")
    started = time.perf_counter()
    backends, env = R.start_run(
        "bench_transformers.py", argv, device, dtype, transformers=transformers.__version__, layers=args.layers,
        batch=args.batch, intermediate=args.intermediate,
    )  # fmt: skip
    timed, not_measured = M.backends_to_time(backends, device, args.backends)
    rows: list[dict[str, Any]] = []
    for heads in args.head_counts:
        model = build_model(heads, args, device, dtype)
        for tokens in args.token_counts:
            gen = torch.Generator().manual_seed(args.seed)
            ids = torch.randint(0, model.config.vocab_size, (args.batch, tokens // args.batch), generator=gen)
            ids = ids.to(device)
            runs = [(name, "") for name in HF_IMPLEMENTATIONS] + [("mla_ops", row["name"]) for row in timed]
            reference = None
            for implementation, backend in runs:
                out = {"heads": heads, "tokens": ids.numel(), "batch": args.batch, "layers": args.layers}
                out.update(implementation=implementation, backend=backend)
                try:
                    model.set_attn_implementation(implementation)
                except Exception as exc:  # an implementation transformers cannot load here (no flash-attn, ...)
                    out["note"] = f"not measured: {R.short_error(exc)}"
                    rows.append(out)
                    continue
                forced = mla_ops.prefill_backend(backend) if backend else contextlib.nullcontext()
                with torch.no_grad(), forced:
                    try:
                        logits = model(ids).logits
                        timing_ = timing.measure(
                            lambda model=model, ids=ids: model(ids),
                            device,
                            warmup_ms=args.warmup_ms,
                            rep_ms=args.rep_ms,
                            flush_l2=False,
                        )
                    except Exception as exc:
                        out["note"] = f"failed: {R.short_error(exc)}"
                        rows.append(out)
                        continue
                out["forward_ms"] = timing_.median_ms
                if reference is None:
                    reference = (logits.float(), timing_.median_ms)
                out["rel_diff"] = M.relative_difference(logits.float(), reference[0])
                out["speedup"] = reference[1] / timing_.median_ms
                rows.append(out)
                print(
                    f"H={heads} tokens={ids.numel()} {implementation:18s} {backend:10s} "
                    f"{timing_.median_ms:9.3f} ms  x{out['speedup']:.2f}  rel diff {out['rel_diff']:.1e}",
                    flush=True,
                )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for name, why in not_measured.items():
        rows.append({"implementation": "mla_ops", "backend": name, "note": f"not measured: {why}"})
    intro = (
        f"`DeepseekV3ForCausalLM` with DeepSeek-V3's attention, {args.layers} layers, dense MLPs of width "
        f"{args.intermediate}, random weights; one prefill forward of {args.batch} sequences, no cache, median "
        "of the timer's samples. *speed-up vs first* and *rel diff* (of the logits) are against the first "
        "implementation measured for that shape (transformers' `sdpa`)."
    )
    paths = R.write_results(
        args.out or R.default_out_dir(device),
        "transformers",
        FIELDS.keys,
        rows,
        env,
        R.results_page("transformers DeepSeek-V3 prefill, attn_implementation", env, intro, FIELDS.table(rows)),
    )
    print(f"wrote {', '.join(str(p) for p in paths)} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
