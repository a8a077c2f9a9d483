"""The Gluon kernel's work-item hand-off on an SM90 GPU (``pytest -m gpu``), isolated from the attention around it.

The kernel's producer warp writes each work item to shared memory (``attention_sm90._put_item``), signals each
consumer warpgroup on a named barrier and arrives on the Q mbarrier; each consumer warpgroup waits for both, reads
the item (``_get_item``) and signals it read on a second named barrier, on which the producer waits before it writes
the next. These kernels run that protocol, with the kernel's own helpers and its partition shape (two warpgroups and
one producer warp), on many items while the producer is slowed down, so that a consumer which read before the
producer wrote would record a stale item:

- ordered (the kernel's protocol): every consumer records every item, in order;
- unordered (no waits on either side): the consumers record stale items, so the first test can fail;
- partitions that share nothing, in every program, with some programs skipping them (as the attention kernel's
  padding programs do), or with the warpgroups' own barriers (a sum over four warps, as the attention kernel's
  partitions have): Triton's warp-specialisation set-up, for what compute-sanitizer reports about it.

Run under compute-sanitizer's racecheck, they separate what it reports about the hand-off from what it reports about
Triton's set-up: docs/design/triton-kernels.md (Under compute-sanitizer).
"""

from __future__ import annotations

import pytest
import torch
from utils import gluon_or_skip

gluon = pytest.importorskip(
    "triton.experimental.gluon", reason="this Triton has no Gluon, which the kernel is written in"
)
import triton  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier  # noqa: E402

from mla_ops.kernels.triton_compat import gluon_triton_reason  # noqa: E402

if gluon_triton_reason(triton.__version__) is not None:  # the kernel's module binds names this release may lack
    pytest.skip(f"the Gluon kernel: {gluon_triton_reason(triton.__version__)}", allow_module_level=True)

from mla_ops.kernels.attention_sm90 import (  # noqa: E402
    _CONSUMER_REGS,
    _MAXNREG,
    _PRODUCER_REGS,
    _await_last_read,
    _get_item,
    _put_item,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
#: Items handed over per program, programs per launch.
ITEMS, PROGRAMS = 64, 8
#: Steps of the producer's busy loop before each item: long enough that unordered consumers finish reading all
#: their items before the producer writes its first.
DELAY = 20000
#: The item the shared slot holds before the producer writes any.
_STALE = gl.constexpr(-7)


@gluon.jit
def _producer(item_smem, seq_smem, full, empty, Seed, ITEMS: gl.constexpr, DELAY: gl.constexpr,
              ORDERED: gl.constexpr):  # fmt: skip
    acc = gl.load(Seed)  # odd, and a multiply-add by an odd and an even number keeps it odd: the delay adds 0
    for n in range(ITEMS):
        if ORDERED:
            mbarrier.wait(empty, (n & 1) ^ 1)
        for _ in range(DELAY):
            acc = acc * 1664525 + 1013904222
        item = 1000 + n + ((acc & 1) ^ 1)
        if ORDERED:
            _put_item(item_smem, item, seq_smem, n, n)
        else:
            item_smem.store(gl.full([1], item, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
        mbarrier.arrive(full, count=1)
    if ORDERED:
        _await_last_read()


@gluon.jit
def _consumer(item_smem, seq_smem, full, empty, Out, WG: gl.constexpr, ITEMS: gl.constexpr, ORDERED: gl.constexpr):
    base = (gl.program_id(0) * 2 + WG) * ITEMS
    for n in range(ITEMS):
        if ORDERED:
            mbarrier.wait(full, n & 1)
            w, _ = _get_item(item_smem, seq_smem, WG)
        else:
            w = gl.max(item_smem.load(gl.BlockedLayout([1], [32], [4], [0])), axis=0)
        gl.store(Out + base + n, w)
        mbarrier.arrive(empty, count=1)  # Gluon's arrive synchronises the warpgroup first: all have read the item


@gluon.jit
def _handoff_kernel(Out, Seed, ITEMS: gl.constexpr, DELAY: gl.constexpr, ORDERED: gl.constexpr):
    item_smem = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    seq_smem = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(full, count=1)
    mbarrier.init(empty, count=2)  # both warpgroups, as the kernel's Q slot
    item_smem.store(gl.full([1], _STALE, gl.int32, gl.BlockedLayout([1], [32], [4], [0])))
    gl.warp_specialize(
        [
            (_consumer, (item_smem, seq_smem, full, empty, Out, 0, ITEMS, ORDERED)),
            (_consumer, (item_smem, seq_smem, full, empty, Out, 1, ITEMS, ORDERED)),
            (_producer, (item_smem, seq_smem, full, empty, Seed, ITEMS, DELAY, ORDERED)),
        ],
        [4, 1],
        [_CONSUMER_REGS, _PRODUCER_REGS],
    )


@gluon.jit
def _worker(Out, WG: gl.constexpr, SYNC: gl.constexpr):
    value = WG + 1
    if SYNC and WG < 2:  # a sum over the warpgroup's four warps: shared scratch and the partition's own barrier
        ones = gl.full([128], 1, gl.int32, gl.BlockedLayout([1], [32], [4], [0]))
        value = gl.sum(ones, axis=0) // 128 * (WG + 1)
    gl.store(Out + gl.program_id(0) * 3 + WG, value)


@gluon.jit
def _prologue_kernel(Out, num_partitioned, SYNC: gl.constexpr):
    # Programs from num_partitioned on skip the partitions, as the attention kernel's padding programs do.
    if gl.program_id(0) >= num_partitioned:
        gl.store(Out + gl.program_id(0) * 3 + 1, -1)
    else:
        gl.warp_specialize(
            [(_worker, (Out, 0, SYNC)), (_worker, (Out, 1, SYNC)), (_worker, (Out, 2, SYNC))],
            [4, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )


def _handoff(ordered: bool) -> torch.Tensor:
    """``[PROGRAMS, 2, ITEMS]``: the item each consumer warpgroup of each program read at each step."""
    out = torch.full((PROGRAMS, 2, ITEMS), -1, dtype=torch.int32, device=DEVICE)
    seed = torch.tensor([12345], dtype=torch.int32, device=DEVICE)
    _handoff_kernel[(PROGRAMS,)](out, seed, ITEMS, DELAY, ordered, num_warps=4, maxnreg=_MAXNREG)
    torch.cuda.synchronize()
    return out.cpu()


@pytest.fixture(autouse=True)
def _sm90():
    gluon_or_skip(DEVICE)


def test_ordered_handoff_delivers_every_item_in_order() -> None:
    got = _handoff(ordered=True)
    want = (1000 + torch.arange(ITEMS, dtype=torch.int32)).expand(PROGRAMS, 2, ITEMS)
    assert torch.equal(got, want), f"consumers read {got[got != want][:8].tolist()} where the producer wrote items"


def test_unordered_handoff_reads_stale_items() -> None:
    # Without the waits the consumers read the slot before the producer writes: what the first test would see
    # if the mbarriers did not order the hand-off.
    got = _handoff(ordered=False)
    assert (got == _STALE.value).any(), "consumers that do not wait still read every item: the delay is too short"


@pytest.mark.parametrize(
    ("skipping", "sync"), [(0, False), (4, False), (0, True)], ids=["all-partitioned", "some-skip", "partitions-sync"]
)
def test_partitions_sharing_nothing_run(skipping: int, sync: bool) -> None:
    out = torch.zeros(PROGRAMS + skipping, 3, dtype=torch.int32, device=DEVICE)
    _prologue_kernel[(PROGRAMS + skipping,)](out, PROGRAMS, sync, num_warps=4, maxnreg=_MAXNREG)
    want = torch.tensor([[1, 2, 3]] * PROGRAMS + [[0, -1, 0]] * skipping, dtype=torch.int32)
    assert torch.equal(out.cpu(), want)
