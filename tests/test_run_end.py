"""``engine.run_end``: the Ctrl-C rule and the exit status record, in-process without a trainer."""

import signal
import threading
from types import SimpleNamespace

import pytest

from hookloop.engine import parallel, run_end
from hookloop.engine.control import StepControl
from hookloop.engine.errors import PeerCrashed, PeerFailure
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.exit_status import read_exit_status, write_exit_status
from hookloop.engine.run_end import SIGINT_STOP_REASON, RunEnd


def make(run_dir, *, started: bool = True, graceful_sigint: bool = True):
    control = StepControl()
    state = SimpleNamespace(iteration=12, last_checkpoint="ckpt/step_12")
    started_flag = SimpleNamespace(started=started)
    return RunEnd(control, started_flag, lambda: state, run_dir, graceful_sigint=graceful_sigint), control


def test_nothing_is_written_before_the_run_started_or_without_a_run_dir(tmp_path):
    end, _ = make(tmp_path, started=False)
    end.write(0, "finished")
    assert read_exit_status(tmp_path) is None
    end, _ = make(None)
    end.write(0, "finished")  # no run directory: nowhere to write, no error
    end, _ = make(tmp_path, started=False)
    end.record_error(PeerFailure("no quorum"))  # a start ended with 77: recorded for the requeue
    assert read_exit_status(tmp_path)["code"] == 77


def test_rank_zero_records_code_reason_step_and_checkpoint(tmp_path):
    end, _ = make(tmp_path)
    end.write(int(ExitCode.STOPPED), "SIGTERM received")
    record = read_exit_status(tmp_path)
    assert (record["code"], record["meaning"], record["reason"]) == (75, "STOPPED", "SIGTERM received")
    assert (record["step"], record["checkpoint"]) == (12, "ckpt/step_12")
    assert "rank" not in record


def test_an_error_is_recorded_with_the_rank_whose_error_it_was(tmp_path):
    end, _ = make(tmp_path)
    with pytest.raises(RuntimeError), end.running():
        raise RuntimeError("boom")
    record = read_exit_status(tmp_path)
    assert (record["code"], record["reason"], record["rank"]) == (1, "RuntimeError: boom", 0)
    end.record_error(PeerCrashed("rank 3 failed", rank=3))
    assert read_exit_status(tmp_path)["rank"] == 3


@pytest.fixture
def rank_one(monkeypatch):
    monkeypatch.setattr(parallel, "rank", lambda: 1)


def test_another_nodes_first_worker_records_only_a_77_rank_zero_has_not_recorded(
    tmp_path, monkeypatch, rank_one
):
    monkeypatch.setenv("LOCAL_RANK", "0")
    end, _ = make(tmp_path)
    with end.running():
        end.write(int(ExitCode.STOPPED), "not this rank's to say")
        assert read_exit_status(tmp_path) is None
        end.write(int(ExitCode.HEALTH_CHECK_FAILED), "peer lost")
        assert read_exit_status(tmp_path)["reason"] == "peer lost"
        end.write(int(ExitCode.HEALTH_CHECK_FAILED), "refined")  # its own record may be refined
        assert read_exit_status(tmp_path)["reason"] == "refined"
    with end.running():
        write_exit_status(tmp_path, code=1, reason="rank 0 recorded the end")  # since the run began
        end.write(int(ExitCode.HEALTH_CHECK_FAILED), "peer lost")
    assert read_exit_status(tmp_path)["reason"] == "rank 0 recorded the end"
    monkeypatch.setenv("LOCAL_RANK", "1")  # not the node's first worker
    assert not run_end.first_on_node()


def test_first_ctrl_c_asks_for_a_stop_with_a_checkpoint_second_interrupts(tmp_path, capsys):
    end, control = make(tmp_path)
    before = signal.getsignal(signal.SIGINT)
    assert before is signal.default_int_handler
    with end.running():
        handler = signal.getsignal(signal.SIGINT)
        handler(signal.SIGINT, None)  # noted; the request is made at the next agreement point
        assert not control.stop
        end.poll()
        assert control.stop and control.save and control.exit_code == ExitCode.STOPPED
        assert control.stop_reason == SIGINT_STOP_REASON
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the second interrupts
    assert signal.getsignal(signal.SIGINT) is before
    assert SIGINT_STOP_REASON in capsys.readouterr().err


def test_ctrl_c_is_left_alone_when_not_graceful_off_the_main_thread_or_taken(tmp_path):
    end, _ = make(tmp_path, graceful_sigint=False)
    with end.running():
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    end, _ = make(tmp_path)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(end._install_sigint()))
    thread.start()
    thread.join()
    assert seen == [None]

    def own(signum, frame):
        pass

    previous = signal.signal(signal.SIGINT, own)
    try:
        with end.running():
            assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, previous)


def _leave(port: int, world: int, delay: float, timeout: float, out) -> None:
    import time

    import torch.distributed as dist

    from hookloop.engine import parallel

    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=__import__("datetime").timedelta(seconds=10)
    )
    time.sleep(delay)
    called = time.time()
    left = parallel.leave_together(store, world, timeout)
    out.put((delay, called, time.time(), left))


@pytest.mark.distributed
def test_ranks_leave_together_when_the_last_arrives_and_never_wait_past_the_timeout():
    """Two processes: the one that arrives first waits for the other (which comes 1.5 s later) and
    both leave within moments of its arrival; alone, a rank waits no longer than the timeout."""
    import datetime
    import multiprocessing
    import time

    import torch.distributed as dist

    host = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_leave, args=(host.port, 2, d, 20.0, out)) for d in (0.0, 1.5)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    (_, first_called, first_left, first_ok), (_, last_called, last_left, last_ok) = results
    assert first_ok and last_ok
    assert first_left >= last_called  # the first waited for the last
    assert abs(first_left - last_left) < 1.0 and last_left - last_called < 1.0

    fresh = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # a new job's store
    alone = ctx.Process(target=_leave, args=(fresh.port, 2, 0.0, 1.0, out))
    started = time.time()
    alone.start()
    try:
        _, _, left_at, ok = out.get(timeout=60)
    finally:
        alone.join(10)
        if alone.is_alive():
            alone.kill()
    assert not ok and left_at - started < 15  # bounded by its 1 s timeout (+ the start of a process)


@pytest.mark.parametrize("leaving", [False, True])
def test_a_stopped_rank_of_several_keeps_its_stop_signals_noted_only_when_the_process_leaves(
    tmp_path, monkeypatch, leaving
):
    """``hookloop train`` leaves once its run ends (``exit_after_run``): a rank of several that
    stopped then keeps SIGTERM noted, so the launcher's SIGTERM after a peer's exit 75 cannot end
    it with -15; a Python caller's run puts the handler back."""
    monkeypatch.setattr(parallel, "world_size", lambda: 2)
    monkeypatch.setattr(run_end, "_exit_after_run", leaving)
    before = signal.getsignal(signal.SIGTERM)
    end, _ = make(tmp_path)
    end.stops = run_end.StopSignals(["SIGTERM"])
    try:
        with end.running():
            installed = signal.getsignal(signal.SIGTERM)
            end.stop_kind = "signal"  # the ranks agreed a stop
        assert installed is not before
        assert signal.getsignal(signal.SIGTERM) is (installed if leaving else before)
        if leaving:
            signal.raise_signal(signal.SIGTERM)  # noted, not fatal
    finally:
        end.stops.restore()
    assert signal.getsignal(signal.SIGTERM) is before
