"""Sweep launch configurations of the Triton kernels on a CUDA GPU and print the best ones.

For DeepSeek's (Dqk, Dv) = (192, 128) in bfloat16 it times every candidate configuration on:

- the new-tokens (causal) path: 4 x 4096 tokens at H=16, 2 x 8192 at H=128, and a mixed batch
  [512, 1024, 2048, 3000, 700] at H=128;
- the context-chunk (non-causal) path: 1024 new tokens over 8192 of context, at H=16 and H=128;

after first checking each candidate against the package's reference on a small ragged batch. It
reports TFLOP/s (FLOPs = 2 * H * (Dqk + Dv) * pairs, pairs = s(s+1)/2 causal, sq * sk for a chunk),
the best configuration per shape, and FlashInfer's fa3 kernel on the same shapes when ``flashinfer``
imports, so the ratio comes from one run. It also sweeps the merge kernel (GB/s) at T=16384, H=128,
Dv=128. Results go to a CSV (``--out``); the best configurations are printed as lines to paste into
``mla_ops/kernels/configs.py``.

Usage::

    python benchmarks/tune_triton.py --out results/tune.csv
    python benchmarks/tune_triton.py --out tune.csv --candidates "128,64,8,3;128,128,8,2,1" --no-flashinfer
"""

from __future__ import annotations

import argparse
import csv
import math
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

DQK, DV = 192, 128
DTYPE = torch.bfloat16

#: (label, lengths of the new tokens, heads)
CAUSAL_SHAPES = [
    ("4x4096 H16", [4096] * 4, 16),
    ("2x8192 H128", [8192] * 2, 128),
    ("mixed H128", [512, 1024, 2048, 3000, 700], 128),
]
#: (label, new-token lengths, context lengths, heads)
CHUNK_SHAPES = [
    ("1k over 8k H16", [1024], [8192], 16),
    ("1k over 8k H128", [1024], [8192], 128),
]

#: Candidates for SM90 (227 KiB shared memory). "tma" loads K/V through TMA descriptors.
DEFAULT_CANDIDATES = [
    "128,64,8,2",
    "128,64,8,3",
    "128,64,8,4",
    "128,128,8,2",
    "128,32,8,4",
    "64,64,4,3",
    "64,128,4,2",
    "128,64,8,2,tma",
    "128,64,8,3,tma",
    "128,64,8,4,tma",
    "128,128,8,2,tma",
]
QUICK_CANDIDATES = ["128,64,8,3", "128,128,8,2", "128,64,8,3,tma"]

MERGE_CANDIDATES = [(bt, w) for bt in (4, 8, 16, 32, 64) for w in (2, 4, 8)]


def log(*args: object) -> None:
    print(*args, flush=True)


def causal_flops(lengths: list[int], heads: int) -> float:
    return 2.0 * heads * (DQK + DV) * sum(s * (s + 1) // 2 for s in lengths)


def chunk_flops(lengths_q: list[int], lengths_k: list[int], heads: int) -> float:
    return 2.0 * heads * (DQK + DV) * sum(a * b for a, b in zip(lengths_q, lengths_k))


def offsets(lengths: list[int], device: torch.device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def bench(fn: Callable[[], object], warmup: int, rep: int) -> float:
    """Median milliseconds of ``fn`` (triton.testing.do_bench, which flushes L2 between runs)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


_TENSORS: dict[tuple[str, str], tuple[torch.Tensor, ...]] = {}


@dataclass
class Problem:
    label: str
    causal: bool
    heads: int
    lengths_q: list[int]
    lengths_k: list[int]
    flops: float

    def tensors(self, device: torch.device):
        """``(q, k, v, cu_q, cu_k)``, built once per problem (about 3.5 GB for all of them)."""
        key = (self.label, str(device))
        if key not in _TENSORS:
            _TENSORS[key] = self._build(device)
        return _TENSORS[key]

    def _build(self, device: torch.device):
        gen = torch.Generator(device=device).manual_seed(0)
        tq, tk = sum(self.lengths_q), sum(self.lengths_k)
        q = torch.randn(tq, self.heads, DQK, device=device, dtype=DTYPE, generator=gen)
        k = torch.randn(tk, self.heads, DQK, device=device, dtype=DTYPE, generator=gen)
        v = torch.randn(tk, self.heads, DV, device=device, dtype=DTYPE, generator=gen)
        cu_q = offsets(self.lengths_q, device)
        cu_k = cu_q if self.causal else offsets(self.lengths_k, device)
        return q, k, v, cu_q, cu_k


def problems() -> list[Problem]:
    out = [Problem(label, True, h, lens, lens, causal_flops(lens, h)) for label, lens, h in CAUSAL_SHAPES]
    out += [Problem(label, False, h, lq, lk, chunk_flops(lq, lk, h)) for label, lq, lk, h in CHUNK_SHAPES]
    return out


def check_candidate(config, device: torch.device) -> str | None:
    """Run ``config`` on small ragged batches (both paths) against the reference; the problem, or None."""
    from mla_ops.backends.reference import attention_reference
    from mla_ops.kernels.attention import attention_triton

    gen = torch.Generator(device=device).manual_seed(1)
    heads = 16
    lengths_q = [1, 17, 0, 127, 300, 64]
    lengths_k = [40, 0, 5, 130, 257, 64]
    for causal in (True, False):
        lk = lengths_q if causal else lengths_k
        q = torch.randn(sum(lengths_q) + 3, heads, DQK, device=device, dtype=DTYPE, generator=gen)
        k = torch.randn(sum(lk) + 3, heads, DQK, device=device, dtype=DTYPE, generator=gen)
        kv = torch.randn(sum(lk) + 3, heads, DQK + DV, device=device, dtype=DTYPE, generator=gen)
        v = kv[..., DQK:]
        cu_q = offsets(lengths_q, device)
        cu_k = cu_q if causal else offsets(lk, device)
        scale = DQK**-0.5
        out, lse = attention_triton(q, k, v, cu_q, cu_k, max(lengths_q), max(lk), scale, causal, config=config)
        ref_out, ref_lse = attention_reference(q, k, v, cu_q, cu_k, scale, causal)
        n = sum(lengths_q)
        out, lse, ref_out, ref_lse = out[:n].float(), lse[:, :n], ref_out[:n].float(), ref_lse[:, :n]
        if torch.isnan(out).any() or torch.isnan(lse).any():
            return f"NaN in {'causal' if causal else 'chunk'} output"
        if not torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)):
            return f"{'causal' if causal else 'chunk'}: empty rows differ"
        finite = torch.isfinite(ref_lse)
        # bf16 output of a softmax average of N(0, 1) values: a correct kernel is within a few bf16
        # ulps (~1e-2); a broken configuration is off by O(1).
        out_err = (out - ref_out).abs().max().item()
        lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
        if out_err > 5e-2 or lse_err > 1e-2:
            return f"{'causal' if causal else 'chunk'}: out error {out_err:.3g}, lse error {lse_err:.3g}"
    return None


def gpu_clocks() -> str:
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def sweep_attention(args, device, writer, meta) -> tuple[dict, dict]:
    """Time every candidate on every problem; returns ({label: (tflops, config)}, {config: {label: tflops}})."""
    from mla_ops.kernels.attention import attention_triton, tma_supported
    from mla_ops.kernels.configs import AttentionConfig, table_attention_config

    texts = args.candidates.split(";") if args.candidates else (QUICK_CANDIDATES if args.quick else DEFAULT_CANDIDATES)
    candidates = [AttentionConfig.parse(t, "--candidates") for t in texts]
    if not tma_supported() or torch.cuda.get_device_capability(device) < (9, 0):
        # Without descriptors the launcher would silently run the pointer path under a "tma" label.
        log("TMA descriptors unavailable here (needs Triton >= 3.3 and SM90+): skipping the 'tma' candidates")
        candidates = [c for c in candidates if not c.use_tma]
    cap = torch.cuda.get_device_capability(device)
    for causal in (True, False):
        table = table_attention_config(cap, DQK, DV, causal, DTYPE)
        if table not in candidates:
            candidates.append(table)
        log(f"table config ({'causal' if causal else 'chunk'}): {table}")
    probs = problems()
    best: dict[str, tuple[float, object]] = {}
    results: dict[object, dict[str, float]] = {}
    started = time.time()
    for i, config in enumerate(candidates):
        log(f"[{i + 1}/{len(candidates)}] {config}  ({time.time() - started:.0f} s)")
        try:
            problem = check_candidate(config, device)
        except Exception as exc:  # a configuration the compiler rejects is a result, not a crash
            problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        if problem is not None:
            log(f"    rejected: {problem}")
            writer.writerow({**meta, "kind": "triton", "shape": "check", "config": str(config), "error": problem})
            continue
        results[config] = {}
        for prob in probs:
            q, k, v, cu_q, cu_k = prob.tensors(device)
            scale = DQK**-0.5

            def run(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, prob=prob, scale=scale, config=config):
                return attention_triton(
                    q, k, v, cu_q, cu_k, max(prob.lengths_q), max(prob.lengths_k), scale, prob.causal, config=config
                )

            try:
                ms = bench(run, args.warmup, args.rep)
            except Exception as exc:
                log(f"    {prob.label}: {type(exc).__name__}: {exc}")
                writer.writerow(
                    {**meta, "kind": "triton", "shape": prob.label, "config": str(config), "error": repr(exc)}
                )
                continue
            tflops = prob.flops / ms / 1e9
            results[config][prob.label] = tflops
            log(f"    {prob.label:<18} {ms:8.3f} ms  {tflops:7.1f} TFLOP/s")
            writer.writerow(
                {**meta, "kind": "triton", "path": "causal" if prob.causal else "chunk", "shape": prob.label,
                 "heads": prob.heads, "config": str(config), "ms": f"{ms:.4f}", "tflops": f"{tflops:.1f}"}
            )  # fmt: skip
            if prob.label not in best or tflops > best[prob.label][0]:
                best[prob.label] = (tflops, config)
    return best, results


def time_flashinfer(args, device, writer, meta) -> dict[str, float]:
    """FlashInfer fa3 on the same problems, planned once per shape; {} when flashinfer is absent."""
    if args.no_flashinfer:
        return {}
    try:
        import flashinfer
    except Exception as exc:
        log(f"flashinfer not timed: import failed ({exc!r})")
        return {}
    log(f"flashinfer {flashinfer.__version__}: the first plan compiles the fa3 kernel (a minute or more)")
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
    out: dict[str, float] = {}
    for prob in problems():
        q, k, v, cu_q, cu_k = prob.tensors(device)
        started = time.time()
        try:
            wrapper.plan(
                cu_q, cu_k, num_qo_heads=prob.heads, num_kv_heads=prob.heads, head_dim_qk=DQK, head_dim_vo=DV,
                causal=prob.causal, sm_scale=DQK**-0.5, q_data_type=DTYPE,
            )  # fmt: skip
            ms = bench(lambda q=q, k=k, v=v: wrapper.run(q, k, v, return_lse=True), args.warmup, args.rep)
        except Exception as exc:
            log(f"    fa3 {prob.label}: {type(exc).__name__}: {exc}")
            writer.writerow({**meta, "kind": "flashinfer-fa3", "shape": prob.label, "error": repr(exc)})
            continue
        tflops = prob.flops / ms / 1e9
        out[prob.label] = tflops
        log(f"    fa3 {prob.label:<18} {ms:8.3f} ms  {tflops:7.1f} TFLOP/s  (plan+bench {time.time() - started:.0f} s)")
        writer.writerow(
            {**meta, "kind": "flashinfer-fa3", "path": "causal" if prob.causal else "chunk", "shape": prob.label,
             "heads": prob.heads, "config": "fa3", "ms": f"{ms:.4f}", "tflops": f"{tflops:.1f}"}
        )  # fmt: skip
    return out


def sweep_merge(args, device, writer, meta) -> None:
    from mla_ops.backends.reference import merge_attn_states_reference
    from mla_ops.kernels.merge import merge_attn_states_triton

    tokens, heads, dv = 16384, 128, 128
    gen = torch.Generator(device=device).manual_seed(2)
    prefix_out = torch.randn(tokens, heads, dv, device=device, dtype=DTYPE, generator=gen)
    suffix_out = torch.randn(tokens, heads, dv, device=device, dtype=DTYPE, generator=gen)
    prefix_lse = torch.randn(heads, tokens, device=device, generator=gen) * 3
    suffix_lse = torch.randn(heads, tokens, device=device, generator=gen) * 3
    prefix_lse[:, ::7] = -math.inf
    ref_out, ref_lse = merge_attn_states_reference(prefix_out, prefix_lse, suffix_out, suffix_lse)
    moved = 3 * tokens * heads * dv * prefix_out.element_size() + 3 * tokens * heads * 4
    log(f"merge T={tokens} H={heads} Dv={dv} bf16: {moved / 1e9:.2f} GB moved per call")
    best = None
    for block_t, warps in MERGE_CANDIDATES:

        def run(block_t=block_t, warps=warps):
            return merge_attn_states_triton(
                prefix_out, prefix_lse, suffix_out, suffix_lse, block_t=block_t, num_warps=warps
            )

        out, lse = run()
        err = (out.float() - ref_out.float()).abs().max().item()
        # Two bf16 ulps at the outputs' magnitude: configs may round the fp32 weights differently.
        ok = err <= 2 * 2**-8 * ref_out.float().abs().max().item() and torch.equal(
            torch.isneginf(lse), torch.isneginf(ref_lse)
        )
        ms = bench(run, args.warmup, args.rep)
        gbps = moved / ms / 1e6
        log(f"    block_t={block_t:<3} warps={warps}  {ms:7.3f} ms  {gbps:7.1f} GB/s{'' if ok else '  WRONG'}")
        writer.writerow(
            {**meta, "kind": "merge", "path": "merge", "shape": f"T{tokens} H{heads} Dv{dv}", "heads": heads,
             "config": f"block_t={block_t},warps={warps}", "ms": f"{ms:.4f}", "gbps": f"{gbps:.1f}",
             "error": "" if ok else f"max error {err:.3g}"}
        )  # fmt: skip
        if ok and (best is None or gbps > best[0]):
            best = (gbps, block_t, warps)
    if best is not None:
        log(f"best merge: block_t={best[1]}, warps={best[2]}: {best[0]:.1f} GB/s")
        log(f"  -> SM90_MERGE = MergeConfig(block_t={best[1]}, num_warps={best[2]})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", required=True, help="CSV file to write (one row per candidate and shape)")
    parser.add_argument(
        "--candidates",
        default="",
        help="';'-separated attention configs 'BLOCK_M,BLOCK_N,num_warps,num_stages[,tma]' (default: a built-in list)",
    )
    parser.add_argument("--quick", action="store_true", help="three candidates only (a smoke run)")
    parser.add_argument("--no-flashinfer", action="store_true", help="skip timing FlashInfer fa3")
    parser.add_argument("--no-merge", action="store_true", help="skip the merge kernel sweep")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up time, ms (default 25)")
    parser.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms (default 100)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        log("tune_triton.py needs a CUDA device: torch.cuda.is_available() is False")
        return 2
    import triton

    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    cap = torch.cuda.get_device_capability(device)
    try:
        import flashinfer

        fi_version = flashinfer.__version__
    except Exception:
        fi_version = ""
    meta = {
        "gpu": name,
        "capability": f"{cap[0]}.{cap[1]}",
        "clocks": gpu_clocks(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "triton": triton.__version__,
        "flashinfer": fi_version,
        "python": platform.python_version(),
    }
    log(" | ".join(f"{k}={v}" for k, v in meta.items()))
    fields = [*meta, "kind", "path", "shape", "heads", "config", "ms", "tflops", "gbps", "ratio_vs_fa3", "error"]
    started = time.time()
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        best, results = sweep_attention(args, device, writer, meta)
        fa3 = time_flashinfer(args, device, writer, meta)
        _TENSORS.clear()
        torch.cuda.empty_cache()
        if not args.no_merge:
            sweep_merge(args, device, writer, meta)
        log("")
        log("best Triton configuration per shape (192/128 bf16):")
        for label, (tflops, config) in best.items():
            ratio = f"  {tflops / fa3[label]:.2f}x fa3 ({fa3[label]:.0f})" if label in fa3 else ""
            log(f"  {label:<18} {tflops:7.1f} TFLOP/s  {config}{ratio}")
            writer.writerow(
                {**meta, "kind": "best", "shape": label, "config": str(config), "tflops": f"{tflops:.1f}",
                 "ratio_vs_fa3": f"{tflops / fa3[label]:.3f}" if label in fa3 else ""}
            )  # fmt: skip
        # One entry per path: the configuration with the best geometric mean over that path's shapes.
        for causal, labels in ((True, [s[0] for s in CAUSAL_SHAPES]), (False, [s[0] for s in CHUNK_SHAPES])):
            scored = [
                (math.exp(sum(math.log(r[lb]) for lb in labels) / len(labels)), c)
                for c, r in results.items()
                if all(lb in r for lb in labels)
            ]
            if scored:
                score, config = max(scored, key=lambda t: t[0])
                tma = ", use_tma=True" if config.use_tma else ""
                log(
                    f"  -> SM90_ATTENTION[({DQK}, {DV}, {causal})] = AttentionConfig("
                    f"{config.block_m}, {config.block_n}, {config.num_warps}, {config.num_stages}{tma})"
                    f"  # geomean {score:.1f} TFLOP/s"
                )
    log(f"wrote {args.out} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
