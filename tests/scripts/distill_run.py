"""examples/distill.py's run as the example builds it (body, teacher, shipped handlers), for the
kill-and-resume test: ``python tests/scripts/distill_run.py RUN_DIR OUT STEPS [--kill-at N]``
under torchrun.

Trains to STEPS (resuming from RUN_DIR's newest complete checkpoint), saving every 5 steps and
validating with each save; ``--kill-at N``: rank 1 kills itself with SIGKILL at the end of step N (after
its step-N handlers), a hard death mid-run. At the end each rank writes ``OUT.<rank>``
(``torch.save``): the student's parameters, the optimizer state, and on the final model the
student's cross entropy and the distillation objective over the whole validation set.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from hookloop import Events, Priority
from hookloop.engine import parallel

REPO = Path(__file__).resolve().parents[2]


def load_example():
    spec = importlib.util.spec_from_file_location("distill_example", REPO / "examples" / "distill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    example = load_example()
    trainer, loader = example.build(args.run_dir, steps=args.steps, ckpt_every_steps=5, val_every_steps=10)

    @trainer.on(Events.STEP_END, priority=Priority.CLEANUP - 1)
    def _kill(engine) -> None:
        if engine.state.step == args.kill_at and parallel.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    state = trainer.run(loader)
    body = trainer.step_body
    student = trainer.model
    _, val = example.make_data()
    features, labels = val.tensors
    student.eval()
    with torch.no_grad():
        logits = student(features)
        ce = F.cross_entropy(logits, labels)
        student.train()  # the body's training objective on the same samples
        _, objective = body.compute_loss(features, labels, trainer.step_context)
    out = {f"p.{n}": p.detach().clone() for n, p in student.named_parameters()}
    for i, s in enumerate(trainer.optimizer.state.values()):
        out.update({f"o.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    out["val_ce"], out["val_objective"] = ce, objective.detach()
    out["exit_code"] = torch.tensor(int(trainer.control.exit_code))
    torch.save(out, f"{args.out}.{parallel.rank()}")
    print(f"DONE {state.step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
