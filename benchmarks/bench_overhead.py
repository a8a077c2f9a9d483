"""Op overhead on the reference shapes, measured in alternating rounds.

``bench_prefill.py`` times each method once per shape, one after another; on long kernels the GPU's
clocks and temperature drift between those measurements by more than the few percent this ratio is
about. Here each backend's op and its own raw library call take turns, round after round, and the
ratio is the median over rounds of (raw time / op time).

FLASH_ATTN is compared twice: with the bare bundled FA2 kernel, and with that kernel plus the copy
into the contiguous ``[T, H, Dv]`` output the op contract requires (``fa2_raw+copy``), which splits
its gap into the copy's cost and the op layer's.

    python benchmarks/bench_overhead.py [--rounds 7] [--out results/h200/overhead.csv]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import bench_prefill as B

# The three reference shapes: 4x4096 at H=16, 2x8192 at H=128, and a mixed batch at H=128.
SHAPES = [
    B.Shape("causal", 16, (4096,) * 4),
    B.Shape("causal", 128, (8192,) * 2),
    B.Shape("causal", 128, (512, 1024, 2048, 3000, 700)),
]


class FlashAttn2RawContiguous(B.FlashAttn2Raw):
    """The bundled FA2 kernel plus the copy that makes its ``[T, H, Dqk]`` output the contiguous
    ``[T, H, Dv]`` the op contract promises. FA2 has no ``Dv != Dqk`` and no ``out=``, so this copy is
    part of any FA2 call that returns the contract's tensor; the gap between this baseline and the
    plain kernel is the copy's cost, the gap between the op and this baseline is the op layer's."""

    name = "fa2_raw+copy"
    implementation = B.FlashAttn2Raw.implementation + ", output sliced to Dv and made contiguous"

    def prepare(self, p: B.Problem) -> B.Prepared:
        kernel = super().prepare(p)
        return B.Prepared(lambda: kernel.fn()[0][..., : B.DV].contiguous(), lambda r: (r, None))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds per pair (default %(default)s)")
    parser.add_argument("--rep-ms", type=float, default=60.0, help="timed milliseconds per measurement")
    parser.add_argument("--out", type=Path, default=None, help="CSV file to write")
    args = parser.parse_args(argv)
    import torch

    import mla_ops
    from mla_ops.backends.registry import PrefillBackendEnum

    if not torch.cuda.is_available():
        print("bench_overhead: needs a CUDA device; none is visible", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    capability = mla_ops.DeviceCapability.of(device)
    config = mla_ops.SelectorConfig(torch.bfloat16, mla_ops.MLADimensions.from_head_dims(B.DQK, B.DV))
    raw_of = {"FLASHINFER": B.FlashInferRaw("fa3" if capability == (9, 0) else "fa2"), "FLASH_ATTN": B.FlashAttn2Raw()}
    pairs = []
    for name in ("TRITON", "FLASH_ATTN", "FLASHINFER"):
        cls, reasons = mla_ops.selector.validate_backend(PrefillBackendEnum[name], capability, config)
        if reasons:
            print(f"{name}: skipped ({'; '.join(reasons)})")
            continue
        raw = raw_of.get(name) or B.BackendDirect(name, cls)
        pairs.append((B.OpMethod(name, cls.implementation()), raw))
        if name == "FLASH_ATTN":
            pairs.append((B.OpMethod(name, cls.implementation()), FlashAttn2RawContiguous()))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, rounds={args.rounds}")
    rows = []
    for shape in SHAPES:
        problem = B.make_problem(shape, device, torch.bfloat16, seed=0)
        for op, raw in pairs:
            prepared = [op.prepare(problem), raw.prepare(problem)]
            times: list[list[float]] = [[], []]
            # Prepared.context is single-use; the override is set once for the whole pair instead.
            mla_ops.set_prefill_backend(op.name)
            for _ in range(args.rounds):
                for i, p in enumerate(prepared):
                    times[i].append(C.time_ms(p.fn, device, warmup_ms=10.0, rep_ms=args.rep_ms))
            mla_ops.set_prefill_backend(None)
            ratios = [r / o for o, r in zip(*times)]
            ratio = statistics.median(ratios)
            op_ms, raw_ms = statistics.median(times[0]), statistics.median(times[1])
            label = f"{len(shape.q_lens)}x{shape.q_lens[0]}" if len(set(shape.q_lens)) == 1 else "mixed"
            print(
                f"{op.name:<11} {label:<8} H={shape.heads:<4} op {op_ms:8.3f} ms  {raw.name:<15} {raw_ms:8.3f} ms  "
                f"ratio {ratio:.3f} (rounds {min(ratios):.3f}..{max(ratios):.3f})",
                flush=True,
            )
            rows.append([op.name, label, shape.heads, f"{op_ms:.4f}", raw.name, f"{raw_ms:.4f}", f"{ratio:.4f}"])
        del problem
        torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["backend", "shape", "heads", "op_ms", "raw_call", "raw_ms", "raw_over_op_median"])
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
