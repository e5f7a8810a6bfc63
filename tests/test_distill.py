"""examples/distill.py: a step body of the user's own (a frozen teacher's KL term beside the task
loss) trains and validates with every shipped handler the example attaches, under DDP with two
processes, and a run killed mid-way resumes to the same parameters and loss history bitwise."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

from hookloop import ConfigError
from tests.dist_utils import REPO, run_torchrun

SCRIPT = REPO / "examples" / "distill.py"
RUNNER = REPO / "tests" / "scripts" / "distill_run.py"
STEPS, KILL_AT = 40, 23


def load_example():
    spec = importlib.util.spec_from_file_location("distill_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def history(run_dir) -> dict[int, dict]:
    """metrics.jsonl by step, the last row of a step logged twice (a resumed run replays the steps
    after its checkpoint), without the wall-clock time."""
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        row.pop("time")
        rows[row["step"]] = row
    return rows


def test_the_teacher_is_frozen_outside_the_optimizer_and_validation_takes_the_bodys_eval_path(tmp_path):
    example = load_example()
    trainer, loader = example.build(tmp_path / "run", steps=4, val_every_steps=4)
    body = trainer.step_body
    assert isinstance(body, example.DistillStepBody) and body.model is trainer.model
    teacher_params = {id(p) for p in body.teacher.parameters()}
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert teacher_params and not teacher_params & optimized
    assert not teacher_params & {id(p) for p in trainer.model.parameters()}
    assert not any(p.requires_grad for p in body.teacher.parameters()) and not body.teacher.training
    assert trainer.stateful["distill"] is body  # the teacher's fingerprint rides in every checkpoint
    before = [p.clone() for p in body.teacher.parameters()]
    state = trainer.run(loader)
    assert state.step == 4 and all(torch.equal(a, b) for a, b in zip(before, body.teacher.parameters()))

    _, val = example.make_data()
    features, labels = val.tensors
    with torch.no_grad():
        ce = float(F.cross_entropy(trainer.model(features), labels))
        _, objective = body.compute_loss(features, labels, trainer.step_context)  # model in training mode
    assert state.metrics["val_loss"] == pytest.approx(ce, rel=1e-5)  # the student's own loss ...
    assert float(objective) > ce + 0.1  # ... not the training objective, which the KL term raises


def test_a_resume_with_another_teacher_is_refused_by_name(tmp_path):
    example = load_example()
    trainer, loader = example.build(tmp_path / "run", steps=2)
    trainer.run(loader)
    other = example.mlp(128, 2)
    torch.save(other.state_dict(), tmp_path / "other_teacher.pt")
    again, loader = example.build(tmp_path / "run", steps=4, teacher=str(tmp_path / "other_teacher.pt"))
    with pytest.raises(ConfigError) as refused:
        again.run(loader)
    assert refused.value.field == "distill.teacher" and "same teacher" in str(refused.value)
    assert not again.started


@pytest.mark.distributed
def test_distill_under_ddp_killed_and_resumed_matches_the_uninterrupted_run(tmp_path):
    """Two gloo ranks train the example's body with its handlers (step scheduler, async
    checkpoints every 5 steps, NaN detector, loggers, validation with each save). Rank 1 dies by SIGKILL
    at the end of step 23; the same command resumes from the newest complete checkpoint and ends
    with the uninterrupted run's parameters, optimizer state and loss history, bit for bit."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    p = run_torchrun(RUNNER, 2, [str(reference), str(tmp_path / "ref.pt"), str(STEPS)])
    assert p.returncode == 0, p.stderr[-3000:]

    killed = run_torchrun(
        RUNNER, 2, [str(run), str(tmp_path / "run.pt"), str(STEPS), "--kill-at", str(KILL_AT)]
    )
    assert killed.returncode != 0 and "DONE" not in killed.stdout
    assert "rank 1 exited with code -9" in killed.stderr, killed.stderr[-3000:]  # by SIGKILL
    assert not (tmp_path / "run.pt.0").exists()
    killed_rows = history(run)
    assert KILL_AT - 1 <= max(killed_rows) <= KILL_AT  # rank 0 cannot pass the step rank 1 died in

    resumed = run_torchrun(RUNNER, 2, [str(run), str(tmp_path / "run.pt"), str(STEPS)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    line = next(x for x in resumed.stderr.splitlines() if "resumed from" in x)
    start = int(line.rsplit("(step ", 1)[1].rstrip(")"))
    assert 5 <= start < KILL_AT and start % 5 == 0, line  # replays the steps after its checkpoint

    for rank in (0, 1):
        ours = torch.load(tmp_path / f"run.pt.{rank}", weights_only=True)
        theirs = torch.load(tmp_path / f"ref.pt.{rank}", weights_only=True)
        assert ours.keys() == theirs.keys()
        assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    expected = history(reference)
    assert history(run) == expected and sorted(expected) == list(range(1, STEPS + 1))
    # the replayed steps logged the same values the killed run had logged for them
    assert all(killed_rows[s] == expected[s] for s in killed_rows)
    # Validation ran through the body's eval path: the student's cross entropy over every
    # validation sample of both ranks, not the training objective (which adds the KL term).
    final = torch.load(tmp_path / "run.pt.0", weights_only=True)
    assert expected[STEPS]["val_loss"] == pytest.approx(float(final["val_ce"]), rel=1e-5)
    assert float(final["val_objective"]) > float(final["val_ce"]) + 0.1
