"""`run_workers`: how the parent reads its ranks' ends (real spawned processes, no process group)."""

import os
import signal
import time

import pytest

from megatron_trace.megatron.spawn import run_workers, save_result


def _saves_then_aborts(rank, outdir):
    """Rank 1 saves its result and then dies by SIGABRT, as a library's exit handler did in CI."""
    save_result({"ok": rank * 10}, outdir, rank)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGABRT)


def _fails_while_other_waits(rank, outdir):
    """Rank 0 raises; rank 1 would wait forever (as in a collective rank 0 left)."""
    if rank == 0:
        save_result({"error": "ValueError: rank 0 went wrong"}, outdir, rank)
        return
    time.sleep(600)


def _dies_without_result(rank, outdir):
    if rank == 1:
        os._exit(7)
    save_result({"ok": rank}, outdir, rank)


def test_a_rank_that_saved_its_result_then_died_still_counts():
    assert run_workers(_saves_then_aborts, 2, ()) == [0, 10]


def test_a_failed_rank_stops_the_others_after_the_grace_period():
    t = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        run_workers(_fails_while_other_waits, 2, (), grace_s=2.0)
    assert time.monotonic() - t < 60  # not the 600 s rank 1 would sleep
    assert "rank 0:\nValueError: rank 0 went wrong" in str(e.value)
    assert "rank 1: no result (killed 2 s after another rank failed)" in str(e.value)


def test_a_rank_that_died_without_a_result_is_named_with_its_exit_code():
    with pytest.raises(RuntimeError, match=r"rank 1: no result \(exit code 7\)"):
        run_workers(_dies_without_result, 2, (), grace_s=5.0)
