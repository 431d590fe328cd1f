"""The CPU's activation figure is the peak of what torch's allocator hands
out while a run lasts: it must be exact, repeat, see a peak the run has
left behind by its end, and leave the process's stderr as it was but for
the profiler's own start and stop lines."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import torch

from ringserve.plan.audit import measure_peak, peak_of

CPU = torch.device("cpu")
MIB = 2**20


def test_the_peak_is_every_block_the_run_holds_exactly_and_repeats():
    def run() -> None:
        held = [torch.ones(8192) for _ in range(2048)]  # 32 KiB each, 64 MiB in all
        assert len(held) == 2048

    assert [measure_peak(CPU, run) for _ in range(3)] == [64 * MIB] * 3


def test_the_peak_is_the_highest_point_not_what_is_left_at_the_end():
    kept = []

    def run() -> None:
        big = torch.empty(8 * MIB, dtype=torch.uint8)
        del big
        kept.append(torch.empty(MIB, dtype=torch.uint8))

    assert measure_peak(CPU, run) == 8 * MIB


def test_memory_held_before_the_run_counts_neither_way():
    # its free is not seen (the allocator reports no size for a block from
    # before the profile), so the figure is what the run took: never low
    earlier = [torch.empty(4 * MIB, dtype=torch.uint8)]

    def run() -> None:
        earlier.clear()  # 4 MiB that was live before goes
        held = torch.empty(6 * MIB, dtype=torch.uint8)
        assert held.numel() == 6 * MIB

    assert measure_peak(CPU, run) == 6 * MIB


class _Cycle:
    def __init__(self) -> None:
        self.me = self
        self.blocks = [torch.ones(8192) for _ in range(64)]  # 2 MiB


def test_the_run_goes_with_earlier_garbage_freed_and_no_collection_inside():
    # garbage old enough that only a full collection frees it: left to the
    # collector, it could be freed in the middle of the measured run, and its
    # frees would hide 2 MiB of the run's peak
    cycle = _Cycle()
    gone = weakref.ref(cycle)
    gc.collect()  # the cycle survives into the oldest generation
    del cycle
    seen = []

    def run() -> None:
        seen.append((gone() is None, gc.isenabled()))
        held = [torch.ones(8192) for _ in range(256)]  # 8 MiB
        gc.collect(0)  # what a young collection frees
        assert len(held) == 256

    assert measure_peak(CPU, run) == 8 * MIB
    assert seen == [(True, False)]
    assert gc.isenabled()


def test_stderr_keeps_every_line_the_run_writes_and_loses_the_profilers_banner(capfd):
    def run() -> None:
        os.write(2, b"from the run, below Python\n")
        print("from the run, through Python", file=__import__("sys").stderr, flush=True)

    measure_peak(CPU, run)
    err = capfd.readouterr().err
    assert "from the run, below Python\n" in err
    assert "from the run, through Python\n" in err
    assert "USDT" not in err and "profiler_start" not in err
    assert "ERROR" not in err


def test_a_first_peak_measured_on_another_thread_is_exact_and_prints_nothing():
    # the profiler complains once per process, when it first starts on a
    # thread other than the one that imported torch: a fresh interpreter
    code = """
import threading, torch
from ringserve.plan.audit import measure_peak
def run():
    held = [torch.ones(8192) for _ in range(64)]  # 2 MiB
figures = []
thread = threading.Thread(target=lambda: figures.append(measure_peak(torch.device("cpu"), run)))
thread.start()
thread.join()
figures.append(measure_peak(torch.device("cpu"), run))
print(figures)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == str([2 * MIB, 2 * MIB])
    assert done.stderr == ""


def test_within_one_instant_allocations_count_before_frees():
    assert peak_of([(1, 10), (2, -10), (2, 30), (3, -30)]) == 40
    # a free of a block the run did not take (a stale size, say) is not the run's
    assert peak_of([(5, -4), (6, 3)]) == 3
    assert peak_of([(1, 6), (2, -1), (3, 2), (4, -6)]) == 8
    assert peak_of([(2, 5), (1, 7), (3, -7)]) == 12  # taken in time order
    assert peak_of([]) == 0
