"""Three hooks a user writes, each with an effect that happens in this run (seconds on a CPU).

    python examples/custom_hooks.py
    python examples/custom_hooks.py grad_norms.every=5 early_stop.patience=4 train.run_dir=runs/hooks

1. ``LayerGradNorms``, on ``BEFORE_OPTIMIZER_STEP`` every ``grad_norms.every`` steps: the gradient
   norm of each layer (embeddings, every block, the head), printed and appended to
   ``<run_dir>/grad_norms.jsonl``. At this event the gradients are reduced but not yet clipped, so
   the layer norms sum in quadrature to ``state.grad_norm``, the norm before clipping.
2. Early stopping on validation loss: ignite's own ``EarlyStopping`` on ``Events.VALIDATION_END``.
   It calls ``trainer.terminate()``, a stop every data-parallel rank takes after the same step.
3. A hook firing its own event: ``PlateauDetector`` registers ``PlateauEvents.PLATEAU`` and fires
   it with ``trainer.fire(...)`` when the validation loss stops improving; ``HalveLROnPlateau``, a
   separate handler that knows nothing about the detector, reacts by halving the learning rate.

The detector is a stateful ``hookloop.Handler`` with its own config section (a dataclass whose
``validate`` holds the only copy of its rules); ``compose_config`` adds the sections to the run
config, so ``plateau.patience=3`` works on the command line and is validated like a shipped
section (see docs/writing_handlers.md). Validation runs every ``step_scheduler.val_every_steps``
steps.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ignite.engine import EventEnum
from ignite.handlers import EarlyStopping

from hookloop import ConfigError, Events, Handler, Trainer, check_int, check_number
from hookloop.engine.data import TokenDataset, prepare_tokens, stdlib_docs_text
from hookloop.handlers import compose_config, load_run_config
from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss


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
    measured before clipping; printed and appended to ``path`` (JSON lines) when given."""

    Config = GradNormsConfig
    section = "grad_norms"

    def __init__(self, every: int = 25, path: str | Path | None = None) -> None:
        GradNormsConfig(every=every).validate(prefix="LayerGradNorms")
        self.every, self.path = every, Path(path) if path is not None else None

    def attach(self, trainer: Trainer) -> LayerGradNorms:
        trainer.add_event_handler(Events.BEFORE_OPTIMIZER_STEP(every=self.every), self.report)
        return super().attach(trainer)

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


# ------------------------------------------------------------------ 3. a hook firing its own event
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
    """Reacts to ``PlateauEvents.PLATEAU``: halve every parameter group's learning rate."""

    def attach(self, trainer: Trainer) -> HalveLROnPlateau:
        trainer.add_event_handler(PlateauEvents.PLATEAU, self.halve)
        return self

    def halve(self, trainer: Trainer) -> None:
        groups = trainer.optimizer.param_groups
        before = groups[0]["lr"]
        for group in groups:
            group["lr"] *= 0.5
        trainer.state.lr = groups[0]["lr"]
        print(
            f"step {trainer.state.step:4d} plateau #{trainer.state.plateaus} "
            f"(val_loss {trainer.state.metrics['val_loss']:.4f}): "
            f"lr {before:.2e} -> {groups[0]['lr']:.2e}"
        )


# ------------------------------------------------------------------ 2. early stop (ignite's own)
@dataclass
class EarlyStopConfig:
    """The ``early_stop`` section: ignite ``EarlyStopping`` on the validation loss."""

    enabled: bool = True
    patience: int = 3
    min_delta: float = 0.02

    def validate(self, prefix: str = "early_stop") -> None:
        check_int(f"{prefix}.patience", self.patience, hint="validations without improvement")
        check_number(f"{prefix}.min_delta", self.min_delta, low=0, hint="the smallest loss drop that counts")


ExampleConfig = compose_config(grad_norms=GradNormsConfig, plateau=PlateauConfig, early_stop=EarlyStopConfig)
DEFAULTS = [
    "train.run_dir=runs/custom_hooks",
    "train.seq_len=32",
    "step_scheduler.max_steps=400",
    "step_scheduler.val_every_steps=20",
    "optimizer.lr=0.003",
]


def token_file(cache_dir: Path) -> Path:
    path = cache_dir / "stdlib_docs.u8"
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        prepare_tokens([stdlib_docs_text()], path)
    return path


def main(argv: list[str]) -> int:
    try:
        cfg = load_run_config(None, [*DEFAULTS, *argv], schema=ExampleConfig)
        if cfg.step_scheduler.val_every_steps is None:
            raise ConfigError("step_scheduler.val_every_steps", "is null: the hooks react to validation")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(cfg.train.seed)
    torch.set_num_threads(cfg.train.num_threads or 1)  # a model this small runs fastest on one thread
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "grad_norms.jsonl").unlink(missing_ok=True)
    tokens = TokenDataset(token_file(Path(cfg.data.cache_dir)), cfg.train.seq_len)
    # A small training slice (about 4k tokens) that the model overfits within a few hundred steps:
    # the validation loss levels off, then rises, which is what the hooks below watch for.
    n_train, n_val = 128, 64
    train_set = torch.utils.data.Subset(tokens, range(n_train))
    val_set = torch.utils.data.Subset(tokens, range(len(tokens) - n_val, len(tokens)))
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(cfg.train.seed)
    )
    model = GPT(GPTConfig(seq_len=cfg.train.seq_len, n_layers=2, d_model=64, n_heads=4))
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr),
        cross_entropy_loss,
        grad_accum_steps=2,
        grad_clip_norm=cfg.train.grad_clip_norm,
    )
    trainer.set_validation(
        torch.utils.data.DataLoader(val_set, batch_size=16),
        every_steps=cfg.step_scheduler.val_every_steps,
    )

    @trainer.on(Events.VALIDATION_END)
    def show(engine: Trainer) -> None:
        print(f"step {engine.state.step:4d} val_loss {engine.state.metrics['val_loss']:.4f}")

    # 1. per-layer gradient norms (None when grad_norms.enabled=false)
    norms = LayerGradNorms.from_config(cfg.grad_norms, path=run_dir / "grad_norms.jsonl")
    if norms is not None:
        norms.attach(trainer)
    # 3. the detector fires PLATEAU; a separate handler reacts to it
    detector = PlateauDetector.from_config(cfg.plateau)
    if detector is not None:
        detector.attach(trainer)
        HalveLROnPlateau().attach(trainer)
    # 2. ignite's EarlyStopping, unchanged: a higher score is better, so score the negated loss
    if cfg.early_stop.enabled:
        stopper = EarlyStopping(
            patience=cfg.early_stop.patience,
            score_function=lambda engine: -engine.state.metrics["val_loss"],
            trainer=trainer,
            threshold=cfg.early_stop.min_delta,
        )
        trainer.add_event_handler(Events.VALIDATION_END, stopper)

    max_steps = cfg.step_scheduler.max_steps
    state = trainer.run(loader, max_steps=max_steps)
    how = f"stopped early: {state.stop_reason}" if state.step < max_steps else "reached max_steps"
    print(
        f"finished at step {state.step} of {max_steps} ({how}); plateaus: {getattr(state, 'plateaus', 0)}; "
        f"final lr {trainer.optimizer.param_groups[0]['lr']:.2e}; "
        f"val_loss {state.metrics.get('val_loss', float('nan')):.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
