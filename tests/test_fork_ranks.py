"""The ranks the tests start as forks (``tests/scripts/fork_ranks.py``) are ranks as torchrun and
``benchmarks.launch.run_ranks`` start them: their own processes and environment, one process group,
results in rank order, and a failure that ends the others and is reported."""

from __future__ import annotations

import os
import time

import pytest

from tests.dist_utils import run_distributed, run_torchrun


def _who(rank: int, world_size: int, tag: str) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return {
        "tag": tag,
        "pid": os.getpid(),
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ.get("EXTRA")),
        "sum": int(t),
        "threads": torch.get_num_threads(),
    }


def _fails_on_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one gives up")
    time.sleep(300)  # ended by the launcher, not by its own end


def test_a_function_runs_on_every_rank_and_returns_in_rank_order():
    out = run_distributed(_who, 3, "x", env={"EXTRA": "e"}, timeout=120)
    assert [o["env"] for o in out] == [("0", "3", "e"), ("1", "3", "e"), ("2", "3", "e")]
    assert [o["sum"] for o in out] == [6, 6, 6] and {o["tag"] for o in out} == {"x"}
    assert len({o["pid"] for o in out} | {os.getpid()}) == 4
    assert [o["threads"] for o in out] == [1, 1, 1]


def test_a_failing_rank_is_reported_and_ends_the_others_at_once():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*ValueError: rank one gives up"):
        run_distributed(_fails_on_one, 2, timeout=120)
    assert time.monotonic() - started < 60  # rank 0 did not sleep its 300 s


SCRIPT = """
import os, signal, sys, time
import torch.distributed as dist
rank = int(os.environ["RANK"])
print("rank", rank, os.environ["TORCHELASTIC_RUN_ID"] != "", sys.argv[1:], flush=True)
dist.init_process_group("gloo")  # through the launcher's store, as under torchrun
dist.barrier()
if sys.argv[1] == "fail":
    if rank == 0:
        signal.signal(signal.SIGTERM, lambda *_: (print("rank 0 got SIGTERM", flush=True), sys.exit(143)))
        time.sleep(300)
    sys.exit(7)
"""


@pytest.mark.parametrize("how", ["ok", "fail"])
def test_a_script_runs_as_torchruns_workers_and_a_failure_ends_the_rest_with_sigterm(tmp_path, how):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    proc = run_torchrun(script, 2, [how], timeout=120)
    for rank in (0, 1):
        assert f"rank {rank} True ['{how}']" in proc.stdout, proc.stderr
    if how == "ok":
        assert proc.returncode == 0, proc.stderr
        return
    assert proc.returncode == 1 and "rank 0 got SIGTERM" in proc.stdout, proc.stdout + proc.stderr
    assert "rank 1 exited with code 7" in proc.stderr and "rank 0 exited with code 143" in proc.stderr


def test_a_module_runs_with_its_arguments_in_the_commands_directory(tmp_path):
    (tmp_path / "mymod.py").write_text("import os, sys; print(os.getcwd(), sys.argv[1:], __name__)")
    proc = run_torchrun("mymod", 2, ["a", "b"], module=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(f"{tmp_path} ['a', 'b'] __main__") == 2, proc.stdout
