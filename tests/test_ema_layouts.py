"""WeightEMA through the front door under DDP, FSDP2, tensor and pipeline parallelism (2 gloo ranks
each, under torchrun): a run stopped and resumed holds the average of the uninterrupted run
bitwise, validation publishes ``val_loss_ema`` on every rank, ``hookloop export --ema`` writes the
average the ranks held, and an FSDP2 checkpoint's sharded average resumes in one process."""

from __future__ import annotations

import re
import shutil
import sys

import pytest
import torch
import yaml

from tests.dist_utils import REPO, run_process, run_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = REPO / "tests" / "scripts" / "ema_stop.py"
LAYOUTS = {
    "ddp": {"dp_mode": "ddp"},
    "fsdp": {"dp_mode": "fsdp"},
    "tp2": {"dp_mode": "none", "tp_size": 2},
    "pp2": {"dp_mode": "none", "pp_size": 2},
}


def _config(tmp_path, name: str, distributed: dict, stop: int | None, how: str = "StopAt") -> tuple:
    run_dir = tmp_path / name
    handlers = [
        {"target": "hookloop.handlers.ema:WeightEMA", "enabled": True, "decay": 0.8, "start_step": 1},
        {"target": f"{SCRIPT}:DumpAverage"},
    ]
    if stop is not None:
        handlers.append({"target": f"{SCRIPT}:{how}", "step": stop})
    config = {
        "model": {"target": "hookloop.models.gpt:recipe", "n_layers": 2, "d_model": 32, "n_heads": 2},
        "train": {"seq_len": 16, "local_batch_size": 2, "seed": 0, "run_dir": str(run_dir)},
        "step_scheduler": {
            "global_batch_size": 4,
            "max_steps": 6,
            "ckpt_every_steps": 2,
            "val_every_steps": 2,
        },
        "checkpoint": {"keep_best": 1, "metric": "val_loss_ema"},
        "lr": {"warmup_steps": 1},
        "logging": {"log_interval": 1},
        "data": {
            "datasets": {"docs": "stdlib_docs"},
            "cache_dir": str(tmp_path / "cache"),
            "val_fraction": 0.1,
        },
        "distributed": distributed,
        "handlers": handlers,
    }
    path = tmp_path / f"{name}-{stop}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, run_dir


def _train(path, tmp_path, nproc: int = 2):
    if nproc == 1:
        proc = run_process([sys.executable, "-m", "hookloop", "train", str(path)], cwd=tmp_path, timeout=240)
    else:
        proc = run_torchrun("hookloop", nproc, ["train", str(path)], module=True, cwd=tmp_path)
    return proc


def _dumped(run_dir, rank: int = 0) -> dict:
    return torch.load(run_dir / f"ema_rank{rank}.pt", weights_only=True)


def _export_ema(run_dir, out):
    from safetensors.torch import load_file

    proc = run_process(
        [sys.executable, "-m", "hookloop", "export", str(run_dir), "--ema", "--out", str(out)],
        cwd=run_dir.parent,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(out / "model.safetensors")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_stop_resume_validation_and_export_of_the_average(tmp_path, layout):
    distributed = LAYOUTS[layout]
    straight, straight_dir = _config(tmp_path, "straight", distributed, None)
    proc = _train(straight, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stopped, stopped_dir = _config(tmp_path, "stopped", distributed, 3)
    proc = _train(stopped, tmp_path)
    assert proc.returncode == 75 or "test stop" in proc.stdout + proc.stderr, proc.stderr[-4000:]
    step3 = tmp_path / "step3"  # the sharded checkpoint of step 3, before the resume prunes it
    shutil.copytree(stopped_dir / "checkpoints" / "step_00000003", step3)
    resumed, _ = _config(tmp_path, "stopped", distributed, None)
    proc = _train(resumed, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout + proc.stderr

    whole = {}  # the average the ranks hold, under the plain model's names (pipeline stages joined)
    for rank in (0, 1):
        ref, got = _dumped(straight_dir, rank), _dumped(stopped_dir, rank)
        assert got["average"].keys() == ref["average"].keys()
        different = [k for k in ref["average"] if not torch.equal(got["average"][k], ref["average"][k])]
        assert not different, f"rank {rank}: not bitwise equal: {different[:4]}"
        assert got["metrics"]["val_loss_ema"] == ref["metrics"]["val_loss_ema"]
        assert got["metrics"]["val_loss_ema"] != got["metrics"]["val_loss"]
        whole.update({re.sub(r"^\d+\.", "", k): v for k, v in ref["average"].items()})
    on_each = [_dumped(straight_dir, rank)["metrics"]["val_loss_ema"] for rank in (0, 1)]
    assert on_each[0] == on_each[1]  # every rank publishes the same value

    exported = _export_ema(straight_dir, tmp_path / "out")
    assert exported.keys() >= whole.keys()
    assert all(torch.equal(exported[k], whole[k]) for k in whole)
    from hookloop.train import load_model

    loaded = load_model(straight_dir, ema=True).state_dict()
    assert all(torch.equal(loaded[k], exported[k]) for k in exported)
    trained = run_process(
        [sys.executable, "-m", "hookloop", "export", str(straight_dir), "--out", str(tmp_path / "plain")],
        cwd=tmp_path,
        timeout=120,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    from safetensors.torch import load_file

    plain = load_file(tmp_path / "plain" / "model.safetensors")
    assert plain.keys() == exported.keys()
    assert not torch.equal(plain["tok_emb.weight"], exported["tok_emb.weight"])

    if layout in ("fsdp", "pp2"):  # step 3's average resumes in one process, resharded / joined
        single, single_dir = _config(tmp_path, "single", {"dp_mode": "none"}, None)
        (single_dir / "checkpoints").mkdir(parents=True)
        shutil.copytree(step3, single_dir / "checkpoints" / "step_00000003")
        proc = _train(single, tmp_path, nproc=1)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "resumed from" in proc.stdout + proc.stderr and "starts fresh" not in proc.stdout + proc.stderr
        one = _dumped(single_dir)
        for k, v in whole.items():
            torch.testing.assert_close(one["average"][k], v, rtol=1e-4, atol=1e-5)
        assert one["metrics"]["val_loss_ema"] == pytest.approx(ref["metrics"]["val_loss_ema"], rel=1e-4)


def test_a_killed_one_process_run_resumes_to_the_uninterrupted_average(tmp_path):
    """SIGKILL at the start of step 5 (the save of step 4 maybe still in flight), then the same
    command again: the average of the uninterrupted run, bitwise."""
    one = {"dp_mode": "none"}
    straight, straight_dir = _config(tmp_path, "straight", one, None)
    assert _train(straight, tmp_path, nproc=1).returncode == 0
    killed, killed_dir = _config(tmp_path, "killed", one, 5, how="KillAt")
    assert _train(killed, tmp_path, nproc=1).returncode == -9
    again, _ = _config(tmp_path, "killed", one, None)
    proc = _train(again, tmp_path, nproc=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout + proc.stderr
    ref, got = _dumped(straight_dir)["average"], _dumped(killed_dir)["average"]
    assert ref.keys() == got.keys()
    assert [k for k in ref if not torch.equal(ref[k], got[k])] == []
