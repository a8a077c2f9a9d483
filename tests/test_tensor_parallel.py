"""Tensor parallelism on CPU: :mod:`mla_ops.parallel` against the unsplit layer.

Two ranks with the gloo backend, started by torchrun on a free localhost port (``tests/tp_worker.py``),
run the split layer on REFERENCE eagerly, in float64 and under ``torch.compile``. The in-process tests
check the sharding arithmetic with no process group, the errors, when the ops switch devices, that
selection reads each device's own capability, and what ``benchmarks/bench_tp.py`` does without GPUs.
``tests/test_gpu_multi.py`` repeats the two-rank checks on GPUs with NCCL.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tp_worker import launch

import mla_ops
from mla_ops.cli.demo import attention_fp64
from mla_ops.model import MLAAttention, MLAConfig, random_batch
from mla_ops.parallel import TensorParallelMLAAttention, heads_per_rank, shard_state_dict
from mla_ops.runtime import capture
from mla_ops.runtime.capture import on_device
from mla_ops.specs import DeviceCapability

CONFIG = MLAConfig(hidden_size=128, num_heads=8, q_lora_rank=48, kv_lora_rank=32)

# Each launch pays for torchrun and two interpreters importing torch (a few seconds); the compile
# run adds Inductor's CPU code generation (about 20 s on two cores). The bounds leave room for a slow
# machine and still end a hung rendezvous or collective.
EAGER_TIMEOUT_S = 180
COMPILE_TIMEOUT_S = 420


def test_two_gloo_ranks_match_the_dense_layer_eagerly() -> None:
    output = launch(["--device", "cpu", "--checks", "eager", "fp64"], timeout=EAGER_TIMEOUT_S)
    assert output.count("passed: eager fp64") == 2, output


def test_two_gloo_ranks_match_the_dense_layer_compiled() -> None:
    output = launch(["--device", "cpu", "--checks", "compile"], timeout=COMPILE_TIMEOUT_S)
    assert output.count("passed: compile") == 2, output


# --- the sharding arithmetic, in one process ----------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank", [None, 48])
@pytest.mark.parametrize("world_size", [2, 4, 8])
@torch.no_grad()
def test_shards_sum_to_the_dense_output(q_lora_rank, world_size) -> None:
    # Each rank's layer is an MLAAttention of H/P heads holding its shard; the sum of their outputs is
    # what the all-reduce computes, and must be the unsplit layer's output to float64 rounding.
    config = dataclasses.replace(CONFIG, q_lora_rank=q_lora_rank)
    torch.manual_seed(0)
    dense = MLAAttention(config, dtype=torch.float64, attention=attention_fp64)
    batch = random_batch(dense, [5, 0, 7], [3, 9, 0], chunk_size=4, generator=torch.Generator().manual_seed(1))
    args = (batch.hidden, batch.positions, batch.cu_seqlens, batch.max_seqlen, batch.context)
    local_config = dataclasses.replace(config, num_heads=heads_per_rank(config.num_heads, world_size))
    total = torch.zeros_like(batch.hidden)
    for rank in range(world_size):
        local = MLAAttention(local_config, dtype=torch.float64, attention=attention_fp64)
        local.load_state_dict(shard_state_dict(dense.state_dict(), config.num_heads, rank, world_size))
        total += local(*args)
    want = dense(*args)
    assert ((total - want).norm() / want.norm()).item() < 1e-12


def test_shards_are_views_of_the_heads_in_order() -> None:
    dense = MLAAttention(CONFIG)
    state = dense.state_dict()
    rank, world_size = 1, 4
    shards = shard_state_dict(state, CONFIG.num_heads, rank, world_size)
    assert shards.keys() == state.keys()
    heads = CONFIG.num_heads // world_size
    rows_q = heads * CONFIG.qk_head_dim
    rows_kv = heads * (CONFIG.qk_nope_head_dim + CONFIG.v_head_dim)
    cols_o = heads * CONFIG.v_head_dim
    assert torch.equal(shards["q_b_proj.weight"], state["q_b_proj.weight"][rank * rows_q : (rank + 1) * rows_q])
    assert torch.equal(shards["kv_b_proj.weight"], state["kv_b_proj.weight"][rank * rows_kv : (rank + 1) * rows_kv])
    assert torch.equal(shards["o_proj.weight"], state["o_proj.weight"][:, rank * cols_o : (rank + 1) * cols_o])
    for name in ("q_a_proj.weight", "q_a_layernorm.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"):
        assert shards[name] is state[name], f"{name} is replicated, passed through as it is"
    for name, shard in shards.items():
        assert shard.untyped_storage().data_ptr() == state[name].untyped_storage().data_ptr(), f"{name} was copied"


def test_shard_state_dict_reads_prefixed_checkpoint_keys() -> None:
    state = {f"model.layers.3.self_attn.{k}": v for k, v in MLAAttention(CONFIG).state_dict().items()}
    shards = shard_state_dict(state, CONFIG.num_heads, 0, 2)
    assert shards["model.layers.3.self_attn.o_proj.weight"].shape == (CONFIG.hidden_size, 4 * CONFIG.v_head_dim)
    assert shards["model.layers.3.self_attn.q_b_proj.weight"].shape == (4 * CONFIG.qk_head_dim, CONFIG.q_lora_rank)
    assert shards["model.layers.3.self_attn.q_a_proj.weight"].shape == (CONFIG.q_lora_rank, CONFIG.hidden_size)


def test_sharding_errors_say_what_to_change() -> None:
    state = MLAAttention(CONFIG).state_dict()
    with pytest.raises(ValueError, match=r"cannot split 8 attention heads over 3 .*\(use one of 1, 2, 4, 8\)"):
        shard_state_dict(state, CONFIG.num_heads, 0, 3)
    with pytest.raises(ValueError, match="rank 2 is outside a tensor-parallel group of 2 ranks"):
        shard_state_dict(state, CONFIG.num_heads, 2, 2)
    halved = shard_state_dict(state, CONFIG.num_heads, 0, 2)
    with pytest.raises(ValueError, match=r"q_b_proj\.weight has 768 entries along dimension 0.*unsplit"):
        shard_state_dict(halved, 5, 0, 5)


def test_layer_needs_an_initialised_process_group() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"torch\.distributed to be initialised: start one process per GPU"):
        TensorParallelMLAAttention(CONFIG)


# --- devices: launches and selection follow the tensors' device ------------------------------------------


def test_on_device_switches_only_to_another_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capture, "current_cuda_device", lambda: 0)
    switch = on_device(torch.device("cuda", 1))
    assert isinstance(switch, torch.cuda.device) and switch.idx == 1
    for device in (torch.device("cuda", 0), torch.device("cpu")):
        stay = on_device(device)
        assert not isinstance(stay, torch.cuda.device), f"{device} is current (or no CUDA device): nothing to switch"
        with stay, stay:  # the shared no-op context can be entered again, also nested
            pass


def test_selection_reads_the_capability_of_the_tensors_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two simulated GPUs of different generations: routing for cuda:1 must ask about cuda:1, not about
    # the current device, and fail for its (unsupported) capability while cuda:0 is served.
    asked: list[int] = []
    capabilities = {0: (9, 0), 1: (7, 5)}

    def capability(device: torch.device) -> tuple[int, int]:
        asked.append(device.index)
        return capabilities[device.index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    mla_ops.clear_cache()
    try:
        assert DeviceCapability.of(torch.device("cuda", 1)) == DeviceCapability(7, 5)
        mla_ops.selector.route(torch.device("cuda", 0), torch.bfloat16, 192, 128)
        with pytest.raises(ValueError, match=r"compute capability 7\.5"):
            mla_ops.selector.route(torch.device("cuda", 1), torch.bfloat16, 192, 128)
    finally:
        mla_ops.clear_cache()
    assert asked == [1, 0, 1]


# --- benchmarks/bench_tp.py: what runs without GPUs -----------------------------------------------------

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_tp.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_tp", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_tp_without_gpus_says_so_and_fails() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    assert "bench_tp: no CUDA GPU is visible" in proc.stderr and "NVIDIA GPUs" in proc.stderr


def test_bench_tp_takes_the_slowest_rank_and_scales_against_one_gpu(tmp_path) -> None:
    bench = _load_bench()
    shape = {"tokens": 8192, "context": 8192, "sequences": 1, "backend": "TRITON", "attention_tflops": 500.0}
    single = {"gpus": 1, "heads_per_gpu": 128, "layer_ms": 12.0, "attention_ms": 8.0, "projections_ms": 4.0}
    one = [[{**shape, **single, "allreduce_ms": None}]]  # one rank, which has no all-reduce
    ranks = [
        [{**shape, "gpus": 2, "heads_per_gpu": 64, "layer_ms": t, "attention_ms": a, "projections_ms": 2.0,
          "allreduce_ms": r, "allreduce_alone_ms": 0.5, "allreduce_busbw_gbs": bw}]
        for t, a, r, bw in ((7.0, 4.0, 1.0, 300.0), (7.5, 4.2, 0.9, 280.0))
    ]  # fmt: skip
    rows = bench.slowest_rank(one) + bench.slowest_rank(ranks)
    bench.add_scaling(rows)
    two = rows[1]
    assert (two["layer_ms"], two["attention_ms"], two["allreduce_ms"], two["allreduce_busbw_gbs"]) == (
        7.5,
        4.2,
        1.0,
        280,
    )
    assert two["speedup"] == pytest.approx(12.0 / 7.5)
    assert two["scaling_efficiency"] == pytest.approx(12.0 / (2 * 7.5))
    assert rows[0]["scaling_efficiency"] == pytest.approx(1.0)
    bench.write_csv(tmp_path / "tp.csv", rows)
    with (tmp_path / "tp.csv").open() as f:
        written = list(csv.DictReader(f))
    assert [r["gpus"] for r in written] == ["1", "2"] and written[1]["scaling_efficiency"] == "0.8000"
    args = bench.parse_args([])
    report = bench.render_markdown(rows, {"gpu": "NVIDIA H200"}, args, "python benchmarks/bench_tp.py", ["4 GPUs"])
    assert "| 2 | 8192 | 8192 | 64 | TRITON | 7.500 | 4.200 |" in report and "80%" in report
    assert "Not measured: 4 GPUs." in report
    assert bench.R.gpu_name_slug("NVIDIA H200") == "h200"  # the results folder it writes into
