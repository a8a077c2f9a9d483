"""Size-aware routing on simulated GPUs: size classes, the cost table's format and predictions, where tables are
found and what a missing, stale or corrupt one does, and the routes that follow (against stand-in tables of
tests/standins.py; the committed table of a GPU comes from ``python -m mla_ops tune`` on it)."""

from __future__ import annotations

import json
import warnings

import pytest
import standins
import torch

import mla_ops
from mla_ops import DeviceCapability, MLADimensions, SelectorConfig, cost_table
from mla_ops import selector as sel
from mla_ops.backends.base import VarlenCall
from mla_ops.cost_table import SizeClass
from mla_ops.meta.checks import checked_attention_sizes

SM90, SM80 = DeviceCapability(9, 0), DeviceCapability(8, 0)
CONFIG = SelectorConfig(torch.bfloat16, MLADimensions(128, 64, 128))
KEY = ("bfloat16", 192, 128)

# Measured classes: a host-bound call, a middle one and a large one, new tokens and chunks.
TINY = SizeClass.of(True, 16, 16, 16, 1, 16, 16)
MIDDLE = SizeClass.of(True, 1024, 1024, 16, 1, 1024, 1024)
LARGE = SizeClass.of(True, 16384, 16384, 16, 4, 4096, 4096)
CHUNK_TINY = SizeClass.of(False, 16, 256, 16, 1, 16, 256)
CHUNK_LARGE = SizeClass.of(False, 1024, 32768, 128, 1, 1024, 32768)
MEASURED = [TINY, MIDDLE, LARGE, CHUNK_TINY, CHUNK_LARGE]


def _fastest(size: SizeClass, candidates=("FLASHINFER", "FLASH_ATTN", "TRITON")) -> str:
    """The stand-in GPU's fastest backend on a measured class: least of the larger of host cost and device time."""
    return min(candidates, key=lambda b: max(standins.STANDIN_HOST_US[b], standins.standin_device_us(b, size)))


@pytest.fixture
def tables(tmp_path):
    """Empty directories of this machine's tables and of the committed ones; returns ``(user, committed)``."""
    user, committed = tmp_path / "user", tmp_path / "committed"
    user.mkdir()
    committed.mkdir()
    cost_table.LOCATIONS.user_dir, cost_table.LOCATIONS.committed_dir = user, committed
    cost_table.LOCATIONS.warned = set()
    sel.clear_cache()
    yield user, committed
    sel.clear_cache()


def _write(directory, data, name="sm90.json") -> None:
    (directory / name).write_text(data if isinstance(data, str) else json.dumps(data))
    sel.clear_cache()


# --- size classes -----------------------------------------------------------------------------------------


def test_a_size_class_is_the_bit_length_of_each_size() -> None:
    size = SizeClass.of(False, 4096, 8191, 16, 3, 4096, 0)
    assert tuple(size) == (False, 13, 13, 5, 2, 13, 0)
    assert size.bounds() == "chunk Tq 4096-8191 Tk 4096-8191 H 16-31 B 2-3 max_q 4096-8191 max_k 0"
    assert SizeClass.of(True, 1, 1, 1, 1, 1, 1).bounds() == "new Tq 1 H 1 B 1 max_q 1"


def _call(lengths, context=None, heads=4, padding=0, seed=0) -> VarlenCall:
    gen = torch.Generator().manual_seed(seed)
    tq = sum(lengths) + padding
    tk = tq if context is None else sum(context) + padding
    q = torch.randn(tq, heads, 192, generator=gen).bfloat16()
    k = q if context is None else torch.randn(tk, heads, 192, generator=gen).bfloat16()
    v = torch.randn(tk, heads, 128, generator=gen).bfloat16()
    cu_q = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    if context is None:
        return VarlenCall(q, k, v, cu_q, cu_q, max(lengths), max(lengths), 0.1, True)
    cu_k = torch.tensor([0, *torch.tensor(context).cumsum(0).tolist()], dtype=torch.int32)
    return VarlenCall(q, k, v, cu_q, cu_k, max(lengths), max(context), 0.1, False)


CALLS = [
    ([5, 0, 9], None, 0),
    ([3000], None, 7),
    ([1] * 17, None, 0),
    ([5, 0, 9], [2, 0, 3], 0),
    ([12, 1], [40, 4], 3),
    ([64] * 4, [0, 0, 0, 0], 0),
]


@pytest.mark.parametrize(("lengths", "context", "padding"), CALLS)
def test_the_ops_hot_path_computes_the_size_class_of_a_call(tables, all_installed, lengths, context, padding) -> None:
    # route_call builds the class inline; it must be size_class(call), which select_backend and info use.
    _write(tables[0], standins.cost_table(MEASURED))
    entry = sel.routing_entry(SM90, CONFIG)
    assert isinstance(entry, sel.SizedRoute)
    sel._routes[(torch.device("cpu"), torch.bfloat16, 192, 128, False)] = entry
    call = _call(lengths, context, padding=padding)
    routed = sel.route_call(call)
    size = cost_table.size_class(call)
    assert size in entry.chosen  # route_call cached the call's class under its fields: the same class
    assert len(entry.chosen) == 1, "one entry per class met"
    assert routed is sel.select_backend(SM90, CONFIG, size=size)
    # The ops route from the sizes their input check read: the same class, the same backend.
    sizes = checked_attention_sizes(*call)
    assert sizes is not None
    met = dict(entry.chosen)
    assert sel.route_checked(call, sizes) is routed
    assert entry.chosen == met, "route_checked found the class route_call cached"


def test_the_fused_op_routes_its_two_parts_by_their_classes(tables, all_installed) -> None:
    # route_fused builds both parts' classes inline, from the checks' sizes or from the calls; the pair must be
    # (size_class(new), size_class(chunk)), which select_backend and info use, cached under one key.
    _write(tables[0], standins.cost_table(MEASURED))
    entry = sel.routing_entry(SM90, CONFIG)
    assert isinstance(entry, sel.SizedRoute)
    sel._routes[(torch.device("cpu"), torch.bfloat16, 192, 128, False)] = entry
    chosen = set()
    for lengths, context in (([5, 0, 9], [2, 0, 3]), ([3000], [40000]), ([12, 1], [40, 4])):
        new, chunk = _call(lengths), _call(lengths, context)
        pair = (cost_table.size_class(new), cost_table.size_class(chunk))
        routed = sel.route_fused(new, chunk)
        assert routed is sel.select_backend(SM90, CONFIG, size=pair)
        met = dict(entry.chosen)
        sizes = (checked_attention_sizes(*new), checked_attention_sizes(*chunk))
        assert sel.route_fused(new, chunk, sizes) is routed
        assert entry.chosen == met, "the checks' sizes found the pair route_fused cached"
        chosen.add(routed.name)
    assert len(chosen) > 1, "the calls reach more than one backend, so the pairs' classes decided"


@pytest.mark.parametrize(("lengths", "context", "padding"), CALLS)
def test_calls_of_one_native_layout_share_a_size_class(lengths, context, padding) -> None:
    # The native library repeats a TRITON launch for every call of a remembered layout (shapes, strides, bounds):
    # such calls must route alike, so the class may read nothing else (not the offsets' values).
    call = _call(lengths, context, padding=padding)
    other = call._replace(
        q=torch.zeros_like(call.q),
        cu_seqlens_q=torch.zeros_like(call.cu_seqlens_q),
        cu_seqlens_k=call.cu_seqlens_k if call.causal else torch.zeros_like(call.cu_seqlens_k),
    )
    assert cost_table.size_class(other) == cost_table.size_class(call)


# --- the table: format, predictions ------------------------------------------------------------------------


def test_a_table_survives_its_file_format(tmp_path) -> None:
    table = cost_table.parse(standins.cost_table(MEASURED))
    path = tmp_path / "sub" / "sm90.json"
    cost_table.write(table, path)
    again = cost_table.load(path)
    assert again.to_json() == table.to_json()  # (times are kept to the nanosecond)
    assert again.device_us[KEY][LARGE]["TRITON"] == pytest.approx(table.device_us[KEY][LARGE]["TRITON"], abs=1e-3)
    assert (again.capability, again.gpu, again.versions) == (SM90, "Stand-in GPU", cost_table.library_versions())
    assert list(path.parent.iterdir()) == [path]  # the atomic write's temporary file is gone
    entry = json.loads(path.read_text())["entries"][0]
    assert entry["sizes"] == TINY.bounds() and entry["path"] == "new"


def test_predictions_on_measured_and_unmeasured_classes() -> None:
    table = cost_table.parse(standins.cost_table(MEASURED))
    # The larger of the host cost and the device time: the host issues a call while the device runs the last.
    for size in MEASURED:
        device = standins.standin_device_us("TRITON", size)
        assert table.predict("TRITON", KEY, size) == pytest.approx(max(5.0, device))
    host_bound = standins.standin_device_us("FLASHINFER", TINY)
    assert host_bound < 30.0 and table.predict("FLASHINFER", KEY, TINY) == pytest.approx(30.0)
    device_bound = standins.standin_device_us("FLASHINFER", LARGE)
    assert device_bound > 30.0 and table.predict("FLASHINFER", KEY, LARGE) == pytest.approx(device_bound)
    # An unmeasured class: the nearest measured one of its path, scaled by the work, never below the fastest call.
    bigger = SizeClass.of(True, 32768, 32768, 16, 4, 8192, 8192)
    ratio = bigger.work() / LARGE.work()
    assert ratio > 1
    device = standins.standin_device_us("FLASHINFER", LARGE) * ratio
    assert table.predict("FLASHINFER", KEY, bigger) == pytest.approx(max(30.0, device))
    empty = SizeClass.of(True, 0, 0, 16, 1, 0, 0)
    assert table.predict("TRITON", KEY, empty) == pytest.approx(max(5.0, standins.standin_device_us("TRITON", TINY)))
    # Nothing measured for the backend, or for the configuration: no prediction.
    assert (
        cost_table.parse(standins.cost_table(MEASURED, backends=("TRITON",))).predict("FLASHINFER", KEY, TINY) is None
    )
    assert table.predict("TRITON", ("float16", 192, 128), TINY) is None
    assert table.choose(["FLASHINFER", "TRITON"], KEY, [TINY]) == "TRITON"
    assert table.choose(["FLASHINFER", "TRITON"], KEY, [LARGE]) == "FLASHINFER"
    assert table.choose(["REFERENCE"], KEY, [LARGE]) is None


def test_a_class_with_its_own_host_costs_is_predicted_with_them(tmp_path) -> None:
    """Per-class host costs win over the backend's median, on the class and on unmeasured classes that take it
    as their nearest: with medians that rank FLASHINFER first on a tiny call (TRITON's median host cost 100 µs),
    the tiny class's own host costs (TRITON 6 µs) rank TRITON first; a class without them keeps the medians.
    They survive the file format."""
    data = standins.cost_table(MEASURED, host_us={"FLASHINFER": 30.0, "FLASH_ATTN": 15.0, "TRITON": 100.0})
    data["entries"][0]["host_us"] = {"FLASHINFER": 50.0, "TRITON": 6.0}
    assert data["entries"][0]["class"] == list(TINY[1:])
    table = cost_table.parse(data)
    tiny_device = {b: standins.standin_device_us(b, TINY) for b in ("FLASHINFER", "TRITON")}
    assert table.predict("TRITON", KEY, TINY) == pytest.approx(max(6.0, tiny_device["TRITON"]))
    assert table.predict("FLASHINFER", KEY, TINY) == pytest.approx(max(50.0, tiny_device["FLASHINFER"]))
    assert table.predict("FLASH_ATTN", KEY, TINY) == pytest.approx(
        max(15.0, standins.standin_device_us("FLASH_ATTN", TINY))
    )
    assert table.choose(["FLASHINFER", "TRITON"], KEY, [TINY]) == "TRITON"
    without = cost_table.parse(standins.cost_table(MEASURED, host_us=data["host_us"]))
    assert without.choose(["FLASHINFER", "TRITON"], KEY, [TINY]) == "FLASHINFER"
    # An unmeasured class nearest to TINY borrows its host costs; MIDDLE has none, so it keeps the median.
    near = SizeClass.of(True, 32, 32, 16, 1, 32, 32)
    assert table.predict("TRITON", KEY, near) == pytest.approx(
        max(6.0, tiny_device["TRITON"] * near.work() / TINY.work(), tiny_device["TRITON"])
    )
    middle_device = standins.standin_device_us("TRITON", MIDDLE)
    assert table.predict("TRITON", KEY, MIDDLE) == pytest.approx(max(100.0, middle_device))
    path = tmp_path / "sm90.json"
    cost_table.write(table, path)
    again = cost_table.load(path)
    assert again.to_json() == table.to_json() and again.class_host_us == table.class_host_us
    assert json.loads(path.read_text())["entries"][0]["host_us"] == {"FLASHINFER": 50.0, "TRITON": 6.0}
    assert "host_us" not in json.loads(path.read_text())["entries"][1]


BAD = {
    "not JSON": ("{", "it is not JSON"),
    "a list": ("[]", "not a JSON object"),
    "another schema": ({"schema": 99}, "it has schema 99; this mla_ops reads schema 1"),
    "a bad capability": ({"capability": "nine"}, "capability: cannot parse compute capability 'nine'"),
    "an unknown backend": ({"host_us": {"CUDNN": 3.0}}, "host_us names no backend: 'CUDNN'"),
    "a negative time": ({"host_us": {"TRITON": -1}}, "host_us['TRITON'] must be a finite number of microseconds"),
    "bad entries": ({"entries": [{"dtype": "float32"}]}, "entries[0].dtype must be 'bfloat16' or 'float16'"),
    "a bad class host cost": (
        {
            "entries": [
                {
                    "dtype": "bfloat16",
                    "dims": [192, 128],
                    "path": "new",
                    "class": [5] * 6,
                    "device_us": {},
                    "host_us": {"TRITON": "fast"},
                }
            ]
        },
        "entries[0].host_us['TRITON'] must be a finite number of microseconds",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_a_malformed_table_is_refused_with_what_is_wrong(tmp_path, case) -> None:
    fields, message = BAD[case]
    path = tmp_path / "sm90.json"
    path.write_text(fields if isinstance(fields, str) else json.dumps(standins.cost_table(MEASURED, **fields)))
    with pytest.raises(cost_table.CostTableError) as raised:
        cost_table.load(path)
    assert message in str(raised.value)


# --- where tables come from, and what a bad one does ---------------------------------------------------------


def test_no_table_keeps_the_fixed_order_silently(tables, all_installed) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cost_table.table_source(SM90) == (None, "none: fixed order")
        assert not isinstance(sel.routing_entry(SM90, CONFIG), sel.SizedRoute)
        assert sel.select_backend(SM90, CONFIG, size=TINY).name == "FLASHINFER"


def test_this_machines_table_wins_over_the_committed_one(tables, all_installed) -> None:
    user, committed = tables
    _write(committed, standins.cost_table(MEASURED, backends=("FLASHINFER", "FLASH_ATTN")))
    table, source = cost_table.table_source(SM90)
    assert source == f"committed: {committed / 'sm90.json'}" and table is not None
    assert sel.select_backend(SM90, CONFIG, size=TINY).name == "FLASH_ATTN"  # TRITON was not measured there
    _write(user, standins.cost_table(MEASURED))
    assert cost_table.table_source(SM90)[1] == f"tuned: {user / 'sm90.json'}"
    assert sel.select_backend(SM90, CONFIG, size=TINY).name == "TRITON"


def test_a_committed_tables_backend_on_other_libraries_is_no_candidate(tables, all_installed) -> None:
    """The committed table comes from another machine: FLASH_ATTN measured on FlashAttention-4 keeps no times where
    another FlashAttention (or none, PyTorch's bundled copy) is installed, and the source says so; the others'
    versions may differ, and a machine with the same libraries keeps every backend."""
    here = cost_table.library_versions()
    absent = cost_table.NOT_INSTALLED
    measured = dict(here, **{"flash-attn-4": "4.0.0b36", "flash-attn": absent, "flash-attn-3": absent})
    _write(tables[1], standins.cost_table(MEASURED, versions=dict(measured, triton="0.0.1")))
    fa4_here = here["flash-attn-4"] != absent and here["flash-attn"] == here["flash-attn-3"] == absent
    table, source = cost_table.table_source(SM90)
    assert table is not None and table.predict("TRITON", KEY, TINY) is not None  # another Triton: still used
    if fa4_here:
        assert table.predict("FLASH_ATTN", KEY, TINY) is not None and "left out" not in source
    else:
        assert table.predict("FLASH_ATTN", KEY, TINY) is None
        assert "FLASH_ATTN left out: measured with flash-attn-4, here" in source
        assert sel.select_backend(SM90, CONFIG, size=LARGE).name == "FLASHINFER"
    foreign = cost_table.parse(standins.cost_table(MEASURED, versions=measured)).foreign_backends(
        dict(measured, **{"flash-attn-4": absent, "flash-attn": "2.8.3"})
    )
    assert foreign == {"FLASH_ATTN": "measured with flash-attn-4, here flash-attn"}
    # Without any FlashAttention PyTorch's copy runs FLASH_ATTN; without FlashInfer, FLASHINFER cannot run at all.
    none = dict(measured, **{"flash-attn-4": absent, "flashinfer-python": absent})
    assert cost_table.parse(standins.cost_table(MEASURED, versions=measured)).foreign_backends(none) == {
        "FLASH_ATTN": "measured with flash-attn-4, here PyTorch's bundled FlashAttention-2"
    }
    assert cost_table.parse(standins.cost_table(MEASURED, versions=measured)).foreign_backends(measured) == {}


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ("{not json", "it is not JSON"),
        (standins.cost_table(MEASURED, versions={"torch": "1.0"}), "it was measured with other versions (mla_ops"),
        (standins.cost_table(MEASURED, schema=0), "it has schema 0"),
        (standins.cost_table(MEASURED, capability="8.0"), "it was measured on compute capability 8.0, not 9.0"),
    ],
    ids=["corrupt", "stale", "old schema", "other capability"],
)
def test_a_stale_or_corrupt_table_warns_once_and_falls_back(tables, all_installed, data, problem) -> None:
    user, committed = tables
    _write(committed, standins.cost_table(MEASURED, backends=("FLASHINFER", "FLASH_ATTN")))
    _write(user, data)
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(3):
            assert sel.select_backend(SM90, CONFIG, size=TINY).name == "FLASH_ATTN"  # the committed table's choice
            sel.clear_cache()  # read again: still one warning per process
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert str(user / "sm90.json") in message and problem in message
    assert "Routing uses the committed table instead; run `python -m mla_ops tune`" in message
    assert cost_table.table_source(SM90)[1].startswith(f"committed: {committed / 'sm90.json'} (this machine's")


def test_a_corrupt_committed_table_warns_once_and_the_fixed_order_decides(tables, all_installed) -> None:
    _write(tables[1], "garbage")
    with pytest.warns(RuntimeWarning, match="Routing uses the fixed order of backends instead") as caught:
        for size in (TINY, LARGE):
            assert sel.select_backend(SM90, CONFIG, size=size).name == "FLASHINFER"
    assert len(caught) == 1


def test_a_bad_table_never_fails_a_call(tables) -> None:
    # CPU calls never read a table; a GPU's route does, and falls back (tests above); the op runs either way.
    _write(tables[0], "garbage")
    call = _call([5, 3])
    out, _ = torch.ops.mla.prefill(call.q, call.k, call.v, call.cu_seqlens_q, 5, 0.1)
    assert out.shape == (8, 4, 128)


def test_the_cache_directory_follows_xdg(monkeypatch, tmp_path) -> None:
    cost_table.LOCATIONS.user_dir = None
    monkeypatch.delenv("MLA_OPS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cost_table.user_table_path(SM90) == tmp_path / "mla_ops" / "tables" / "sm90.json"
    monkeypatch.setenv("MLA_OPS_CACHE_DIR", str(tmp_path / "mine"))
    assert cost_table.user_table_path(SM90) == tmp_path / "mine" / "tables" / "sm90.json"
    monkeypatch.setenv("MLA_OPS_CACHE_DIR", "/dev/null")  # invalid: no table, never an error in a call
    assert cost_table.user_table_path(SM90) is None


def test_every_committed_table_loads() -> None:
    # The package's tables (mla_ops/tables/sm<NN>.json), each produced by `python -m mla_ops tune` on that GPU.
    committed = cost_table.Locations().committed_dir
    for path in sorted(committed.glob("*.json")):
        table = cost_table.load(path)
        assert path.name == cost_table.table_name(table.capability)
        assert table.command.startswith("python -m mla_ops tune")


# --- routes by size ------------------------------------------------------------------------------------------


@pytest.fixture
def standin_table(tables, all_installed):
    _write(tables[0], standins.cost_table(MEASURED))


@pytest.mark.usefixtures("standin_table")
def test_each_measured_class_routes_to_its_fastest_backend() -> None:
    chosen = {size: sel.select_backend(SM90, CONFIG, size=size).name for size in MEASURED}
    assert chosen == {size: _fastest(size) for size in MEASURED}
    assert chosen[TINY] == "TRITON" and chosen[LARGE] == "FLASHINFER"  # host-bound, and device-bound
    # Without a size, and where the route needs one backend for every size: the fixed order.
    assert sel.select_backend(SM90, CONFIG).name == "FLASHINFER"
    assert sel.route(torch.device("cpu"), torch.bfloat16, 192, 128).name == "REFERENCE"


@pytest.mark.usefixtures("standin_table")
def test_the_fused_op_takes_the_least_summed_time() -> None:
    for new in MEASURED[:3]:
        for chunk in MEASURED[3:]:
            want = min(
                ("FLASHINFER", "FLASH_ATTN", "TRITON"),
                key=lambda b: sum(standins.STANDIN_HOST_US[b] + standins.standin_device_us(b, s) for s in (new, chunk)),
            )
            assert sel.select_backend(SM90, CONFIG, size=(new, chunk)).name == want
            parts = {sel.select_backend(SM90, CONFIG, size=s).name for s in (new, chunk)}
            if len(parts) == 1:  # both parts alone route to one backend: so does the fused op (the native rule)
                assert want in parts


@pytest.mark.usefixtures("standin_table")
def test_inside_graph_trees_only_device_offset_backends_compete() -> None:
    assert sel.select_backend(SM90, CONFIG, in_graph=True, size=LARGE).name == _fastest(LARGE, ("FLASH_ATTN", "TRITON"))
    assert sel.select_backend(SM90, CONFIG, in_graph=True, size=TINY).name == "TRITON"


@pytest.mark.usefixtures("standin_table")
def test_an_override_forces_one_backend_for_every_size(monkeypatch) -> None:
    with mla_ops.prefill_backend("FLASH_ATTN"):
        assert {sel.select_backend(SM90, CONFIG, size=s).name for s in MEASURED} == {"FLASH_ATTN"}
    monkeypatch.setenv(sel.ENV_VAR, "TRITON")
    sel.clear_cache()
    assert {sel.select_backend(SM90, CONFIG, size=s).name for s in MEASURED} == {"TRITON"}


@pytest.mark.usefixtures("standin_table")
def test_families_and_configurations_without_a_table_keep_the_fixed_order() -> None:
    assert {sel.select_backend(SM80, CONFIG, size=s).name for s in MEASURED} == {"FLASH_ATTN"}
    fp16 = SelectorConfig(torch.float16, CONFIG.mla_dimensions)
    assert {sel.select_backend(SM90, fp16, size=s).name for s in MEASURED} == {"FLASHINFER"}


@pytest.mark.usefixtures("standin_table")
def test_a_warm_route_is_a_lookup(monkeypatch) -> None:
    entry = sel.routing_entry(SM90, CONFIG)
    sel._routes[(torch.device("cpu"), torch.bfloat16, 192, 128, False)] = entry
    call = _call([5, 9])
    sel.route_call(call)
    predictions = []
    real = entry.table.choose
    monkeypatch.setattr(entry.table, "choose", lambda *a: predictions.append(a) or real(*a))
    for _ in range(20):
        sel.route_call(call)
    assert predictions == []
    sel.route_call(_call([500, 900]))  # another class: predicted once
    assert len(predictions) == 1


@pytest.mark.usefixtures("standin_table")
def test_the_graph_tree_check_sees_every_backend_a_size_may_route_to() -> None:
    entry = sel.routing_entry(SM90, CONFIG)
    assert {b.name for b in entry.may_run()} == {"FLASHINFER", "FLASH_ATTN", "TRITON"}
    sel._routes[(torch.device("cpu"), torch.bfloat16, 192, 128, False)] = entry
    q, v = torch.empty(4, 2, 192, dtype=torch.bfloat16), torch.empty(4, 2, 128, dtype=torch.bfloat16)
    assert sel.host_planner_for(q, v).name == "FLASHINFER"
