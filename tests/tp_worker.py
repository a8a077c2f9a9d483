"""One rank of the tensor-parallel checks, and :func:`launch`, which starts them under torchrun.

Every rank builds the same unsplit :class:`MLAAttention` (weights broadcast from rank 0), splits it with
:meth:`TensorParallelMLAAttention.from_dense`, and compares the split layer's output with the unsplit
layer's on the same ragged batches with cached context. Checks, chosen with ``--checks``:

- ``eager``: the split layer as it is, in the layer's dtype;
- ``fp64``: both layers in float64 with a float64 attention, for the ``q_proj`` and the low-rank
  ``q_a_proj``/``q_b_proj`` variants, where the split must agree to rounding (``1e-10``);
- ``compile``: the split layer under ``torch.compile(fullgraph=True, dynamic=True)``;
- ``graph`` (CUDA): the split layer captured once in a CUDA graph over a token budget and replayed
  with other batches written into the same buffers.

Each output must also be bitwise the same on every rank (the all-reduce leaves one sum everywhere).
Usage: ``torchrun --standalone --nproc-per-node 2 tests/tp_worker.py --device cpu --checks eager fp64``.
A failed check raises, so the rank and torchrun exit non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from graph_replays import REPLAYS, StaticBatch, capture, replay_batch, replays

import mla_ops
from mla_ops.cli.demo import attention_fp64
from mla_ops.model import MLAAttention, MLABatch, MLAConfig, random_batch
from mla_ops.parallel import TensorParallelMLAAttention

#: Small layers with DeepSeek's head dims (every CUDA backend serves them), with the low-rank query.
CONFIGS = {
    "cpu": MLAConfig(hidden_size=256, num_heads=4, q_lora_rank=96, kv_lora_rank=64),
    "cuda": MLAConfig(hidden_size=1024, num_heads=16, q_lora_rank=256),
}
#: Ragged batches: (new tokens per sequence, cached context per sequence), zero lengths included.
BATCHES = {
    "cpu": [([5, 0, 9, 3], [7, 2, 0, 12]), ([11, 4], [3, 9])],
    "cuda": [([700, 0, 17, 1], [1500, 3, 0, 1100]), ([127, 999], [1025, 64]), ([4097], [2048])],
}
CHUNK_SIZE = {"cpu": 8, "cuda": 1024}

# Both layers round the projections' outputs to the dtype; the split one also rounds each rank's
# o_proj term before the all-reduce adds them, so the two may differ by a few roundings of the
# output. Twice the dtype's epsilon bounds that; a wrong head mapping is off by O(1).
REL_TOL = {torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps, torch.float16: 2 * torch.finfo(torch.float16).eps}
FP64_TOL = 1e-10

#: The environment every launched rank gets: NVLink multicast stays off, output is unbuffered, and
#: CPU ranks take one thread each so that two of them fit on two cores.
CHILD_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
}


# --- launching ------------------------------------------------------------------------------------


def launch(args: Sequence[str], *, timeout: float, nproc: int = 2, env: Mapping[str, str] | None = None) -> str:
    """Run this file under ``torchrun --standalone`` (a free localhost port) with ``nproc`` ranks.

    Returns the ranks' combined output. Raises ``AssertionError`` holding that output when a rank
    fails or the run outlasts ``timeout`` seconds; then torchrun and its ranks are stopped (see
    :func:`_stop`), so nothing outlives the test.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        __file__,
        *args,
    ]
    child_env = {**os.environ, **CHILD_ENV, **(env or {})}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        output, _ = proc.communicate()
        raise AssertionError(
            f"{' '.join(command)} did not finish within {timeout:.0f} s; its output:\n{output}"
        ) from None
    finally:
        if proc.poll() is None:
            _stop(proc)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited with {proc.returncode}; its output:\n{output}")
    return output


def _children(pid: int) -> list[int]:
    """The ids of ``pid``'s child processes (Linux ``/proc``; empty where it is missing)."""
    children: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return children


def _stop(proc: subprocess.Popen) -> None:
    """Stop torchrun and its ranks. torchrun starts each rank in a session of its own, so killing
    torchrun's process group would leave them running: torchrun is asked to stop them first (SIGTERM),
    then whatever is left of its group and of each rank's group is killed by id."""
    ranks = _children(proc.pid)
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    for pgid in (proc.pid, *ranks):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
            os.killpg(pgid, signal.SIGKILL)
    proc.wait()


# --- the checks, run on every rank -----------------------------------------------------------------


def _log(message: str) -> None:
    print(f"[rank {dist.get_rank()}] {message}", flush=True)


def dense_layer(config: MLAConfig, device: torch.device, dtype: torch.dtype) -> MLAAttention:
    """The unsplit layer, with rank 0's weights on every rank."""
    torch.manual_seed(0)
    layer = MLAAttention(config, device=device, dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():
            dist.broadcast(p, src=0)
    return layer


def batches(layer: MLAAttention, kind: str) -> Iterator[MLABatch]:
    """The same ragged batches on every rank (drawn from a seeded CPU generator)."""
    gen = torch.Generator().manual_seed(1)
    for lengths, context in BATCHES[kind]:
        yield random_batch(layer, lengths, context, chunk_size=CHUNK_SIZE[kind], generator=gen)


def _args(batch: MLABatch) -> tuple:
    return batch.hidden, batch.positions, batch.cu_seqlens, batch.max_seqlen, batch.context


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """``got`` is within ``tol`` of ``want`` in relative Frobenius norm, and the same on every rank."""
    assert not torch.isnan(got).any(), f"{name}: NaN in the split layer's output"
    rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert rel <= tol, f"{name}: split layer differs from the unsplit one by {rel:.3e} (relative), over {tol:.1e}"
    gathered = [torch.empty_like(got) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, got.contiguous())
    assert all(torch.equal(g, gathered[0]) for g in gathered), f"{name}: the ranks' outputs differ"
    _log(f"{name}: relative difference {rel:.2e} (bound {tol:.1e}), identical on every rank")


@torch.no_grad()
def check_eager(dense: MLAAttention, kind: str) -> None:
    tp = TensorParallelMLAAttention.from_dense(dense)
    assert tp.config.num_heads * dist.get_world_size() == dense.config.num_heads
    for i, batch in enumerate(batches(dense, kind)):
        assert_close(f"eager batch {i}", tp(*_args(batch)), dense(*_args(batch)), REL_TOL[batch.hidden.dtype])


@torch.no_grad()
def check_fp64(dense: MLAAttention, kind: str) -> None:
    for q_lora_rank in (None, dense.config.q_lora_rank):
        config = dataclasses.replace(dense.config, q_lora_rank=q_lora_rank)
        exact = dense_layer(config, dense.o_proj.weight.device, torch.float64)
        exact.attention = attention_fp64
        tp = TensorParallelMLAAttention.from_dense(exact)
        for i, batch in enumerate(batches(exact, kind)):
            assert_close(f"fp64 q_lora_rank={q_lora_rank} batch {i}", tp(*_args(batch)), exact(*_args(batch)), FP64_TOL)


@torch.no_grad()
def check_compile(dense: MLAAttention, kind: str) -> None:
    tp = TensorParallelMLAAttention.from_dense(dense)
    torch._dynamo.reset()
    compiled = torch.compile(tp, fullgraph=True, dynamic=True)
    for i, batch in enumerate(batches(dense, kind)):
        want = dense(*_args(batch))
        assert_close(f"compiled batch {i}", compiled(*_args(batch)), want, REL_TOL[batch.hidden.dtype])


@torch.no_grad()
def check_graph(dense: MLAAttention, kind: str) -> None:
    assert kind == "cuda", "CUDA graphs need CUDA tensors"
    tp = TensorParallelMLAAttention.from_dense(dense)
    static = StaticBatch(dense)
    graph, out = capture(tp, static, replay_batch(dense, *REPLAYS[0], seed=0))
    for seed, batch, rows in replays(graph, static, dense):
        want = dense(*_args(batch))
        assert_close(f"graph replay {seed} ({rows} tokens)", out[:rows], want, REL_TOL[want.dtype])
    # NCCL cannot tear its communicator down while a graph that captured one of its collectives lives.
    torch.cuda.synchronize()
    del graph
    mla_ops.release_cuda_graph_buffers()


CHECKS = {"eager": check_eager, "fp64": check_fp64, "compile": check_compile, "graph": check_graph}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--backend", help="CUDA backend to force (CPU tensors always run REFERENCE)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--checks", nargs="+", choices=list(CHECKS), default=["eager"])
    args = parser.parse_args(argv)

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    dense = dense_layer(CONFIGS[args.device], device, getattr(torch, args.dtype))
    for name in args.checks:
        with mla_ops.prefill_backend(args.backend) if args.backend else contextlib.nullcontext():
            CHECKS[name](dense, args.device)
    dist.barrier()
    _log(f"passed: {' '.join(args.checks)}" + (f" on {args.backend}" if args.backend else ""))
    _exit_together(dist.distributed_c10d._get_default_store(), dist.get_world_size())


def _exit_together(store: dist.Store, world_size: int) -> None:
    """Tear the process group down, wait until every rank has, then leave: called only after success (a rank
    that fails exits without it, since tearing NCCL down waits for the other ranks, and for captured graphs
    that a traceback may keep alive; torchrun then stops them).

    The order is what makes the teardown deterministic. Without the wait, the first rank to finish
    ``destroy_process_group`` exited while another was still inside it, and the connections the exit closed
    under that rank's teardown could abort it ("terminate called without an active exception", SIGABRT, after
    it had passed). The wait goes through the launcher's store (``store``, which outlives the process group:
    it is torchrun's TCP store, not a gloo or NCCL connection): a rank leaves only once every rank's
    communicators are gone. Then ``os._exit``, without the interpreter's teardown, in which a rank of the
    compile check sometimes aborted the same way (a native thread of the compiled code's runtime destroyed
    while still joinable).
    """
    dist.destroy_process_group()
    if store.add("tp_worker/torn_down", 1) == world_size:
        store.set("tp_worker/all_torn_down", "1")
    store.wait(["tp_worker/all_torn_down"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
