"""Hooks of your own on the front door: ``hookloop train`` attaches them from the config's
``handlers:`` list next to the shipped checkpoints, logging and NaN rollback (about 10 seconds on
2 idle CPU cores, from the repository root)::

    python examples/custom_hooks.py            # = hookloop train examples/configs/custom_hooks.yaml
    hookloop train examples/configs/custom_hooks.yaml handlers.0.every=5 train.run_dir=runs/hooks

1. ``LayerGradNorms``, on ``BEFORE_OPTIMIZER_STEP`` every ``every`` steps: the gradient norm of each
   layer (embeddings, every block, the head), printed and appended to ``<run_dir>/grad_norms.jsonl``.
   At this event the gradients are reduced but not yet clipped, so the layer norms sum in
   quadrature to ``state.grad_norm``, the norm before clipping.
2. ``PlateauDetector`` registers ``PlateauEvents.PLATEAU`` and fires it with ``trainer.fire(...)``
   when the validation loss stops improving; ``HalveLROnPlateau``, a separate handler that knows
   nothing about the detector, reacts by halving the learning rate (the LR schedule's too, so the
   halving is in the checkpoint). The detector is stateful: its best loss and count are in every
   checkpoint, and a resumed run goes on counting.
3. ``early_stop``: ignite's own ``EarlyStopping`` on ``Events.VALIDATION_END``, built by a factory
   that names the ``trainer`` it needs; its ``terminate()`` is a stop every rank takes after the
   same step, and its counters resume with the run too.

Each class with a ``Config`` dataclass has its arguments validated like a shipped section
(``hookloop check examples/configs/custom_hooks.yaml handlers.1.patience=0`` names
``handlers[1].patience``); the others are checked against their signatures. The data is
``small_docs``: 192 windows of the standard library's documentation, of which the model overfits
the first 128, so the validation loss levels off and then rises: what the hooks watch for.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ignite.engine import EventEnum
from ignite.handlers import EarlyStopping
from torch.utils.data import Dataset

from hookloop import Events, Handler, Priority, Trainer
from hookloop.engine.checks import check_int, check_number
from hookloop.engine.data import stdlib_docs_text

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "custom_hooks.yaml"


class Windows(Dataset):
    """Byte windows of a text: ``(input_ids, labels)``, labels shifted by one."""

    def __init__(self, text: str, seq_len: int) -> None:
        self.ids = torch.tensor(list(text.encode()), dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.ids[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def small_docs(seq_len: int, windows: int = 192) -> Windows:
    """The data (``data.target``): the first ``windows`` windows of the documentation."""
    return Windows(stdlib_docs_text()[: windows * seq_len + 1], seq_len)


# ------------------------------------------------------------------ 1. per-layer gradient norms
@dataclass
class GradNormsConfig:
    """The ``grad_norms`` section."""

    enabled: bool = True
    every: int = 25

    def validate(self, prefix: str = "grad_norms") -> None:
        check_int(f"{prefix}.every", self.every, hint="steps between reports")


class LayerGradNorms(Handler):
    """Every ``every`` steps, the gradient norm of each top-level layer (``blocks.3`` counts as one),
    measured before clipping; printed, and appended to ``<run_dir>/grad_norms.jsonl`` when given."""

    Config = GradNormsConfig
    section = "grad_norms"

    def __init__(self, every: int = 25, run_dir: str | Path | None = None) -> None:
        GradNormsConfig(every=every).validate(prefix="LayerGradNorms")
        self.every = every
        self.path = Path(run_dir) / "grad_norms.jsonl" if run_dir is not None else None

    def attach(self, trainer: Trainer) -> LayerGradNorms:
        trainer.add_event_handler(Events.TRAIN_START, self.forget_undone, priority=Priority.OBSERVE)
        trainer.add_event_handler(Events.BEFORE_OPTIMIZER_STEP(every=self.every), self.report)
        return super().attach(trainer)

    def forget_undone(self, trainer: Trainer) -> None:
        """A resumed run trains again the steps after its checkpoint: drop their old lines."""
        if self.path is None or not self.path.exists():
            return
        rows = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [line for line in rows if json.loads(line)["step"] <= trainer.state.step]
        if len(kept) != len(rows):
            self.path.write_text("".join(line + "\n" for line in kept))

    def report(self, trainer: Trainer) -> None:
        squares: dict[str, float] = {}
        for name, p in trainer.model.named_parameters():
            if p.grad is not None:
                parts = name.split(".")
                layer = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
                squares[layer] = squares.get(layer, 0.0) + float(p.grad.detach().float().square().sum())
        norms = {layer: math.sqrt(s) for layer, s in squares.items()}
        step, total = trainer.state.step, float(trainer.state.grad_norm)
        shown = "  ".join(f"{layer} {n:.3f}" for layer, n in norms.items())
        print(f"step {step:4d} grad norms: {shown}  (state.grad_norm {total:.3f})")
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "grad_norm": total, "layers": norms}) + "\n")


# ------------------------------------------------------------------ 2. a hook firing its own event
class PlateauEvents(EventEnum):
    """This example's own event; ``plateaus`` on the state counts its firings (filters read it)."""

    PLATEAU = "plateau"


@dataclass
class PlateauConfig:
    """The ``plateau`` section."""

    enabled: bool = True
    patience: int = 2
    min_delta: float = 0.02

    def validate(self, prefix: str = "plateau") -> None:
        check_int(f"{prefix}.patience", self.patience, hint="validations without improvement")
        check_number(f"{prefix}.min_delta", self.min_delta, low=0, hint="the smallest loss drop that counts")


class PlateauDetector(Handler):
    """Fire ``PlateauEvents.PLATEAU`` when ``val_loss`` has not dropped by ``min_delta`` below its
    best for ``patience`` validations in a row (then start counting afresh). Stateful: a resumed run
    keeps its best loss and count."""

    Config = PlateauConfig
    section = "plateau"
    state_key = "plateau_detector"

    def __init__(self, patience: int = 2, min_delta: float = 0.02) -> None:
        PlateauConfig(patience=patience, min_delta=min_delta).validate(prefix="PlateauDetector")
        self.patience, self.min_delta = patience, min_delta
        self.best = math.inf
        self.stalled = 0

    def attach(self, trainer: Trainer) -> PlateauDetector:
        if not trainer.is_registered_event(PlateauEvents.PLATEAU):  # once per trainer
            trainer.register_events(*PlateauEvents, event_to_attr={PlateauEvents.PLATEAU: "plateaus"})
            trainer.state.plateaus = 0
        trainer.add_event_handler(Events.VALIDATION_END, self.check)
        return super().attach(trainer)

    def check(self, trainer: Trainer) -> None:
        loss = trainer.state.metrics["val_loss"]
        if loss < self.best - self.min_delta:
            self.best, self.stalled = loss, 0
            return
        self.stalled += 1
        if self.stalled >= self.patience:
            self.stalled = 0
            trainer.fire(PlateauEvents.PLATEAU)  # every handler of PLATEAU runs now

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "stalled": self.stalled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.stalled = state["best"], state["stalled"]


class HalveLROnPlateau:
    """Reacts to ``PlateauEvents.PLATEAU``: halve every parameter group's learning rate, and the LR
    schedule's base rates (the schedule sets the rate at every step; its state is checkpointed)."""

    def attach(self, trainer: Trainer) -> HalveLROnPlateau:
        trainer.add_event_handler(PlateauEvents.PLATEAU, self.halve)
        return self

    def halve(self, trainer: Trainer) -> None:
        groups = trainer.optimizer.param_groups
        before = groups[0]["lr"]
        for group in groups:
            group["lr"] *= 0.5
        schedule = trainer.lr_scheduler
        if schedule is not None:
            schedule.base_lrs = [lr * 0.5 for lr in schedule.base_lrs]
        trainer.state.lr = groups[0]["lr"]
        print(
            f"step {trainer.state.step:4d} plateau #{trainer.state.plateaus} "
            f"(val_loss {trainer.state.metrics['val_loss']:.4f}): "
            f"lr {before:.2e} -> {groups[0]['lr']:.2e}"
        )


# ------------------------------------------------------------------ 3. early stop (ignite's own)
class OnEvent:
    """Attach an ignite handler (a callable taking the engine) to one event; its state, when it has
    one (``EarlyStopping`` does), is checkpointed with the run."""

    def __init__(self, event: Any, handler: Any) -> None:
        self.event, self.handler = event, handler
        self.state_key = type(handler).__name__

    def attach(self, trainer: Trainer) -> None:
        trainer.add_event_handler(self.event, self.handler)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.handler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.handler.load_state_dict(state)


def early_stop(trainer: Trainer, patience: int = 3, min_delta: float = 0.02) -> OnEvent:
    """ignite's ``EarlyStopping`` on the validation loss (a higher score is better: the negated loss)."""
    stopper = EarlyStopping(
        patience=patience,
        score_function=lambda engine: -engine.state.metrics["val_loss"],
        trainer=trainer,
        threshold=min_delta,
    )
    return OnEvent(Events.VALIDATION_END, stopper)


if __name__ == "__main__":
    from hookloop.cli import run, train_script

    run(lambda: train_script(DEFAULT_CONFIG))
