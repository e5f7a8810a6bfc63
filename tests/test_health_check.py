"""HealthCheck: a hung peer turns into a bounded, documented exit (code 77), never a hang."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from hookloop.engine import ConfigError, ExitCode, Trainer
from hookloop.handlers.health_check import HealthCheck
from tests.dist_utils import REPO, kill_ranks, start_ranks

SCRIPT = REPO / "tests" / "scripts" / "obs_health_hang.py"
HARD_TIMEOUT_S = 60


def _launch_ranks(args: list[str], world_size: int = 2) -> list[tuple[int, dict, str]]:
    """Start one process per rank (so each rank's own exit code is seen); kill all of them if they
    are not done within the hard timeout."""
    procs = start_ranks([sys.executable, str(SCRIPT), *args], world_size)
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=HARD_TIMEOUT_S)
            result = next(
                (json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")), {}
            )
            outputs.append((p.returncode, result, err))
    finally:
        kill_ranks(procs)
    return outputs


def test_hung_peer_ends_the_run_with_exit_code_77():
    # rank 1 stops taking part at step 3 for 5 s; the probe's timeout is 3 s
    (code0, res0, err0), (code1, res1, err1) = _launch_ranks(["1", "3", "5", "3"])
    assert code0 == ExitCode.HEALTH_CHECK_FAILED, err0
    assert res0["step"] == 3 and res0["checks"] == 3, "steps 1-2 probed healthy, step 3 failed"
    assert "did not complete within 3s" in res0["error"]
    assert res0["state_exit_code"] == ExitCode.HEALTH_CHECK_FAILED
    assert res0["exception_handlers"] == ["HealthCheckError"], "the exception path ran once"
    assert "health check at step 3 failed on rank 0" in err0, "the failure is logged"
    assert "most recent call first" in err0, "every thread's stack is dumped (stderr: no run_dir)"
    # the sleeper makes no progress for longer than the health timeout: its own watchdog ends it
    # with 77 (or, waking first, its probe fails against the dead peer); it never hangs
    assert code1 == ExitCode.HEALTH_CHECK_FAILED, err1
    assert res1.get("step", 3) == 3
    assert res1 or "no progress" in err1


def test_single_process_probe_is_a_no_op():
    model = torch.nn.Linear(2, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    health = HealthCheck(every_steps=2, timeout_s=1).attach(trainer)
    state = trainer.run([(torch.randn(2, 2), torch.randn(2, 1))] * 5, max_steps=5)
    assert health.checks == 2 and state.control.exit_code == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"every_steps": 0}, "every_steps"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"exit_grace_s": -1}, "exit_grace_s"),
    ],
)
def test_bad_arguments(kwargs, field):
    with pytest.raises(ConfigError) as info:
        HealthCheck(**kwargs)
    assert info.value.field == field


def test_from_config():
    from hookloop.handlers.health_check import HealthConfig

    health = HealthCheck.from_config(HealthConfig(enabled=True, every_steps=7, timeout_s=5))
    assert (health.every_steps, health.timeout_s) == (7, 5.0)


def test_peer_heartbeats_tell_a_slow_peer_from_a_stopped_one():
    """Two ranks' heartbeats on a real store: a peer in a long wait that beats is busy and alive; a
    peer whose beat thread stopped (as SIGSTOP stops it) is reported stopped, so a watchdog in a
    long wait of its own still expires."""
    from torch.distributed import HashStore

    from hookloop.engine.watchdog import PeerHeartbeats

    store = HashStore()
    zero, one = PeerHeartbeats(store, 0, 2), PeerHeartbeats(store, 1, 2)
    assert zero.look(0.05).stopped == [] and zero.look(0.05).busy == []  # no peer started yet
    zero.start(0.05)
    one.start(0.05)
    try:
        look = zero.look(0.05)
        assert look.busy == [] and look.stopped == [] and look.answered
        one.set_busy(True)
        look = zero.look(0.05)
        assert look.busy == [1] and look.stopped == []
        one.stop()  # a stopped process beats no more
        time.sleep(0.2)  # a beat already under way lands first
        look = zero.look(0.05)
        assert look.stopped == [1] and "no heartbeat from rank 1" in look.describe()
    finally:
        zero.stop()
        one.stop()
