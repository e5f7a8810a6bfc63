"""Knowledge distillation with a step body of your own: a small student learns from the labels and
from a frozen teacher's logits, with the shipped handlers (step scheduler, async checkpoints and
exact resume, NaN rollback, JSONL and console logging), on one process or under torchrun::

    python examples/distill.py                        # runs/distill: 300 steps, 10 to 15 s on 2 CPU cores
    torchrun --nproc-per-node 2 examples/distill.py --run-dir runs/distill_ddp     # DDP over gloo
    python examples/distill.py --teacher teacher.pt --run-dir runs/mine            # your teacher's weights

The step is not "forward, loss, backward" on one model, so the example brings its own step body,
``DistillStepBody``: a :class:`hookloop.engine.LocalStepBody` whose ``compute_loss`` runs the teacher
too and adds a KL term. Everything else of the step (gradient accumulation, DDP's gradient sync on
the last microbatch, MICROBATCH, the step's agreement, clipping) is the engine's, and validation
runs through the same body: there it gives the student's own cross entropy.

The teacher is frozen: its parameters are not trained, not in the optimizer and not in the DDP
wrapper (nothing of it is all-reduced). It is not in the checkpoint either: the checkpoint holds the
student, optimizer, schedule, data position and RNG states, plus the teacher's fingerprint (the
body is registered as stateful), so a resume with another teacher is refused by name and a resume
with the same one ends bitwise equal to a run that was never interrupted.

The data is generated: points around ten class centres in 16 dimensions, the classes overlapping
(the best classifier is uncertain near the borders, which is what the teacher's soft logits tell
the student). Without ``--teacher`` the example first trains a teacher with a plain loop (one to
two seconds), the same on every process and every start. See docs/step_bodies.md.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from ignite.metrics import Accuracy
from torch.utils.data import DataLoader, TensorDataset

from hookloop import ConfigError, Trainer
from hookloop.engine import LocalStepBody, StepContext, parallel
from hookloop.engine.parallel import init_distributed, wrap_data_parallel
from hookloop.handlers import AsyncCheckpointer, ConsoleLogger, JSONLLogger, NaNDetector, StepScheduler

N_FEATURES, N_CLASSES = 16, 10


def make_data(n_train: int = 8192, n_val: int = 1024, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """``(features, label)`` samples around ten class centres, the same for a given ``seed``."""
    g = torch.Generator().manual_seed(seed)
    centres = 0.9 * torch.randn(N_CLASSES, N_FEATURES, generator=g)
    labels = torch.randint(0, N_CLASSES, (n_train + n_val,), generator=g)
    features = centres[labels] + torch.randn(n_train + n_val, N_FEATURES, generator=g)
    return (
        TensorDataset(features[:n_train], labels[:n_train]),
        TensorDataset(features[n_train:], labels[n_train:]),
    )


def mlp(hidden: int, depth: int) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    width = N_FEATURES
    for _ in range(depth):
        layers += [torch.nn.Linear(width, hidden), torch.nn.GELU()]
        width = hidden
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, N_CLASSES))


def load_teacher(path: str | None, train: TensorDataset, steps: int = 300) -> torch.nn.Module:
    """The teacher from ``path`` (a ``torch.save``'d state_dict of ``mlp(128, 2)``), else one
    trained here first with a plain loop: deterministic, so every process and every start has the
    same teacher."""
    with torch.random.fork_rng():  # leave the run's own random state as it was
        torch.manual_seed(1)
        teacher = mlp(128, 2)
        if path is not None:
            teacher.load_state_dict(torch.load(path, weights_only=True))
            return teacher
        g = torch.Generator().manual_seed(1)
        optimizer = torch.optim.AdamW(teacher.parameters(), lr=1e-3)
        features, labels = train.tensors
        for _ in range(steps):
            i = torch.randint(0, len(labels), (128,), generator=g)
            loss = F.cross_entropy(teacher(features[i]), labels[i])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return teacher


def fingerprint(module: torch.nn.Module) -> str:
    """A short hash of ``module``'s parameters and buffers."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class DistillStepBody(LocalStepBody):
    """The student's step with a frozen teacher: ``(1 - alpha) * loss_fn(student, labels) + alpha *
    T^2 * KL(teacher || student)`` at temperature ``T`` (Hinton et al., 2015); in validation the
    student's own ``loss_fn``.

    Args:
        model: the student as the Trainer gets it (wrapped in DDP under torchrun).
        teacher: the frozen teacher; never wrapped, never in the optimizer.
        alpha: the weight of the distillation term.
        temperature: softens both distributions; the T^2 keeps the gradients' scale.
    """

    def __init__(
        self, model: torch.nn.Module, teacher: torch.nn.Module, alpha: float = 0.7, temperature: float = 2.0
    ) -> None:
        super().__init__(model)
        self.teacher = teacher.eval().requires_grad_(False)
        self.alpha, self.temperature = alpha, temperature

    def compute_loss(self, inputs: Any, targets: Any, ctx: StepContext) -> tuple[Any, torch.Tensor]:
        logits = self.model(inputs)
        task_loss = ctx.loss_fn(logits, targets)
        if not self.model.training:  # validation: the student on its own
            return logits, task_loss
        with torch.no_grad():
            teacher_logits = self.teacher(inputs)
        t = self.temperature
        distill = F.kl_div(
            F.log_softmax(logits / t, dim=-1),
            F.log_softmax(teacher_logits / t, dim=-1),
            log_target=True,
            reduction="batchmean",
        )
        return logits, (1 - self.alpha) * task_loss + self.alpha * t * t * distill

    # The teacher's weights stay out of the checkpoint; its fingerprint goes in, so a resume can
    # tell that it distils from the same teacher (the body is registered with register_stateful).
    def state_dict(self) -> dict[str, Any]:
        return {"teacher": fingerprint(self.teacher), "alpha": self.alpha, "temperature": self.temperature}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ours = self.state_dict()
        changed = [k for k in ours if state.get(k) != ours[k]]
        if changed:
            raise ConfigError(
                f"distill.{changed[0]}",
                f"is {ours[changed[0]]!r} but the checkpoint was trained with {state.get(changed[0])!r}: "
                "resume with the same teacher and settings, or start a new run directory",
            )


def build(
    run_dir: str | Path,
    *,
    steps: int = 300,
    teacher: str | None = None,
    global_batch_size: int = 64,
    local_batch_size: int = 16,
    ckpt_every_steps: int = 50,
    val_every_steps: int = 50,
) -> tuple[Trainer, DataLoader]:
    """The student, its teacher, the body, the trainer and the handlers, on this process's share of
    the data (joins the process group torchrun describes). ``trainer.run(loader)`` trains."""
    info = init_distributed()
    run_dir = Path(run_dir)
    train, val = make_data()
    frozen = load_teacher(teacher, train)  # before any random draw of the run: the same everywhere
    torch.manual_seed(0)
    model = wrap_data_parallel(mlp(32, 1), "ddp")  # the student only
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    body = DistillStepBody(model, frozen)
    trainer = Trainer(
        model,
        optimizer,
        F.cross_entropy,  # the task loss; the body adds the teacher's term
        step_body=body,
        lr_scheduler=schedule,
        grad_clip_norm=1.0,
        run_dir=run_dir,
    )
    trainer.register_stateful("distill", body)

    rank, world = info.rank, info.world_size
    shard = TensorDataset(*(t[rank::world] for t in train.tensors))  # this rank's samples
    loader = DataLoader(
        shard, batch_size=local_batch_size, shuffle=True, generator=torch.Generator().manual_seed(2)
    )
    StepScheduler(
        global_batch_size,
        local_batch_size,
        world,
        loader,
        max_steps=steps,
        ckpt_every_steps=ckpt_every_steps,
        val_every_steps=val_every_steps,
    ).attach(trainer)
    AsyncCheckpointer(run_dir / "checkpoints", keep_last=2).attach(trainer)  # first: it answers ROLLBACK
    NaNDetector(max_consecutive=3).attach(trainer)
    JSONLLogger(run_dir / "metrics.jsonl").attach(trainer)
    ConsoleLogger(progress_bar=False).attach(trainer)  # no MetricsTracker: every step, as the JSONL
    val_shard = TensorDataset(*(t[rank::world] for t in val.tensors))
    trainer.set_validation(DataLoader(val_shard, batch_size=256), metrics={"accuracy": Accuracy()})
    return trainer, loader


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default="runs/distill")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--teacher", default=None, help="a state_dict of mlp(128, 2); default: train one")
    args = parser.parse_args(argv)
    trainer, loader = build(args.run_dir, steps=args.steps, teacher=args.teacher)
    state = trainer.run(loader)
    metrics = state.metrics
    if parallel.rank() == 0 and "val_loss" in metrics:
        print(
            f"done: step {state.step}, loss {state.loss:.4f}, val_loss {metrics['val_loss']:.4f}, "
            f"val_accuracy {metrics['val_accuracy']:.3f}"
        )
    return int(trainer.control.exit_code)


if __name__ == "__main__":
    sys.exit(main())
