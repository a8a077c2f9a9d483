"""The native merge's loader (mla_ops.native) without building it: when it refuses to try, how a failed
build is reported, the build key, and the sources it ships. The build itself: tests/test_gpu_native.py."""

from __future__ import annotations

import importlib.resources
import warnings

import pytest
import torch

from mla_ops import native
from mla_ops.backends.base import VarlenCall
from mla_ops.runtime import merge_dispatch


@pytest.fixture
def fresh():
    """The loader as in a new process (nothing tried yet), restored afterwards."""
    saved = native.LOADER.state()
    native.LOADER.reset()
    yield native.LOADER
    native.LOADER.restore(saved)


def test_disabled_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    monkeypatch.setattr(fresh, "build", lambda: pytest.fail("built although disabled"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native.load()
    assert native.status() == f"Triton kernel (native kernel unavailable: disabled by {native.DISABLE_VARIABLE}=0)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a machine without CUDA")
def test_refuses_quietly_without_cuda(fresh, monkeypatch):
    monkeypatch.delenv(native.DISABLE_VARIABLE, raising=False)
    monkeypatch.setattr(fresh, "build", lambda: pytest.fail("built without CUDA"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native.load()
    assert native.unavailable_reason() in ("this build of torch has no CUDA", "no CUDA device is visible")
    assert not native.is_loaded()


def test_a_failed_build_warns_once_and_the_merge_falls_back(fresh, monkeypatch):
    calls = []

    def failing_build():
        calls.append(1)
        raise RuntimeError("Error building extension 'mla_ops_native':\nnvcc fatal : Unsupported gpu architecture")

    monkeypatch.setattr(native, "unavailable_reason", lambda: None)
    monkeypatch.setattr(fresh, "build", failing_build)
    monkeypatch.setattr(merge_dispatch, "is_capturing", lambda: False)
    with pytest.warns(RuntimeWarning, match=r"could not build the native kernels \(RuntimeError: nvcc fatal"):
        fn = merge_dispatch.merge_kernel(torch.device("cuda"))
    assert fn is merge_dispatch._triton_or_reference() and fn is not native.merge
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither tried nor reported again
        assert not native.load()
        assert merge_dispatch.merge_kernel(torch.device("cuda")) is fn
    assert calls == [1]
    assert "native kernel unavailable: RuntimeError: nvcc fatal : Unsupported gpu architecture" in native.status()


def test_no_build_during_cuda_graph_capture(fresh, monkeypatch):
    monkeypatch.setattr(native, "load", lambda: pytest.fail("built during capture"))
    monkeypatch.setattr(merge_dispatch, "is_capturing", lambda: True)
    assert merge_dispatch.merge_kernel(torch.device("cuda")) is merge_dispatch._triton_or_reference()
    assert fresh.loaded is None  # decided by the first call outside capture


def test_cpu_tensors_never_touch_the_native_merge(fresh, monkeypatch):
    monkeypatch.setattr(native, "load", lambda: pytest.fail("loaded for CPU tensors"))
    assert merge_dispatch.merge_kernel(torch.device("cpu")) is merge_dispatch.merge_attn_states_reference


def test_build_key_names_everything_the_library_depends_on():
    sources = {"a.cu": b"kernel", "b.cpp": b"op"}
    key = native.build_key(sources, "2.11.0+cu130", "13.0", ["-O3"])
    assert key == native.build_key(dict(reversed(sources.items())), "2.11.0+cu130", "13.0", ["-O3"])
    others = [
        native.build_key({**sources, "a.cu": b"kernel2"}, "2.11.0+cu130", "13.0", ["-O3"]),
        native.build_key(sources, "2.12.0+cu130", "13.0", ["-O3"]),
        native.build_key(sources, "2.11.0+cu130", "12.8", ["-O3"]),
        native.build_key(sources, "2.11.0+cu130", "13.0", ["-O3", "-gencode=arch=compute_100,code=sm_100"]),
        native.build_key(sources, "2.11.0+cu130", "13.0", ["-O3"], python_abi="cpython-313-x86_64-linux-gnu"),
        native.build_key(sources, "2.11.0+cu130", "13.0", ["-O3"], compilers="c++: g++ 14.2; nvcc: 13.0"),
    ]
    assert len({key, *others}) == 7


def test_cache_directory_and_architectures_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(native.CACHE_VARIABLE, str(tmp_path))
    assert native.build_directory("abc") == tmp_path / "native" / "abc"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0;10.0+PTX 8.0")
    assert native.architectures() == ["10.0", "8.0", "9.0"]
    assert native._arch_flags(["9.0", "10.0a"]) == [
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_100a,code=sm_100a",
    ]
    with pytest.raises(ValueError, match=r"TORCH_CUDA_ARCH_LIST: cannot read architecture '9\.x-'"):
        native._arch_flags(["9.x-"])


def test_the_sources_ship_with_the_package():
    csrc = importlib.resources.files("mla_ops.native") / "csrc"
    for name in native.SOURCES:
        assert (csrc / name).is_file(), name
    op = (csrc / "merge_attn_states.cpp").read_text()
    # The C++ kernel raises through the op that mla_ops.ops defines for it, and registers what ops.py leaves free.
    assert '"mla::_check_merge_inputs"' in op and "TORCH_LIBRARY_IMPL(mla, CUDA, m)" in op
    assert torch.ops.mla._check_merge_inputs.default is not None


def test_a_build_killed_midway_does_not_block_the_next(fresh, monkeypatch, tmp_path):
    """PyTorch's builder waits forever on the `lock` file a killed build leaves; the loader removes it once it
    holds its own flock (released by the system when a holder dies), then builds and loads."""
    from torch.utils import cpp_extension

    monkeypatch.setenv(native.CACHE_VARIABLE, str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    directory, name, _ = native._build()
    directory.mkdir(parents=True)
    (directory / "lock").write_text("")  # left by a build that died
    seen = {}

    def fake_load(**kwargs):
        seen.update(kwargs, stale_lock=(directory / "lock").exists())
        (directory / f"{name}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    fresh.build()  # the real build, with the builder replaced above
    assert seen["stale_lock"] is False
    assert seen["name"] == name and seen["build_directory"] == str(directory) and not seen["is_python_module"]
    assert "-gencode=arch=compute_90,code=sm_90" in seen["extra_cuda_cflags"]


def test_the_first_merges_of_two_threads_build_once(fresh, monkeypatch):
    import threading
    import time

    calls = []

    def slow_build():
        calls.append(threading.get_ident())
        time.sleep(0.05)

    monkeypatch.setattr(native, "unavailable_reason", lambda: None)
    monkeypatch.setattr(fresh, "build", slow_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(native.load())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4 and len(calls) == 1


def test_launch_status_says_how_triton_launches(fresh, monkeypatch):
    monkeypatch.setenv(native.LAUNCH_VARIABLE, "0")
    assert native.launch_status() == f"launched through Python: {native.LAUNCH_VARIABLE}=0"
    monkeypatch.delenv(native.LAUNCH_VARIABLE)
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    assert native.launch_status() == (
        f"launched through Python: native library unavailable: disabled by {native.DISABLE_VARIABLE}=0"
    )
    fresh.loaded = fresh.launches = True
    assert native.launch_status() == "a layout's repeated calls launched from C++"
    fresh.launches = False  # nothing to forget in the library this test never loaded


def test_nothing_is_remembered_without_the_library(fresh, monkeypatch):
    """remember_attention hands nothing over where the library is disabled, and forgetting is then a no-op."""
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    t = torch.zeros(4, 2, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    assert not native.remember_attention(native.PREFILL, VarlenCall(t, t, t, cu, cu, 4, 4, 0.25, True))
    assert native.remembered_attention_layouts() == 0
    native.forget_attention()


def test_the_old_name_of_the_off_switch_still_works_and_warns(fresh, monkeypatch):
    monkeypatch.delenv(native.DISABLE_VARIABLE, raising=False)
    monkeypatch.setenv(native.DEPRECATED_DISABLE_VARIABLE, "0")
    with pytest.warns(DeprecationWarning, match=r"MLA_OPS_NATIVE_MERGE is deprecated .* set MLA_OPS_NATIVE=0"):
        assert native.unavailable_reason() == "disabled by MLA_OPS_NATIVE_MERGE=0"
    # The new name wins where both are set.
    monkeypatch.setenv(native.DISABLE_VARIABLE, "1")
    assert native.unavailable_reason() != "disabled by MLA_OPS_NATIVE_MERGE=0"


def test_a_launch_the_library_cannot_repeat_is_not_handed_over(fresh, monkeypatch):
    """Where the installed Triton's launcher is not one the C++ kernel can repeat (any release but 3.6), no
    layout is remembered, so the C++ kernels never take the ops' CUDA key and no TRITON call pays their hop."""
    from mla_ops.kernels import attention

    fresh.loaded = fresh.launches = True  # as if loaded; torch.ops.mla_native must not be reached
    monkeypatch.setattr(attention, "known_native_launch", lambda call: None)
    t = torch.zeros(4, 2, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    assert not native.remember_attention(native.PREFILL, VarlenCall(t, t, t, cu, cu, 4, 4, 0.25, True))
    fresh.launches = False
