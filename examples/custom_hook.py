"""Writing your own hooks: a function on an event, a filtered event, and a stateful handler class
with its own config section.

    python examples/custom_hook.py
    python examples/custom_hook.py loss_spike_guard.factor=2.5 step_scheduler.max_steps=40

A handler is any callable attached to an event; a reusable one is a class with ``attach(trainer)``
(and ``state_dict``/``load_state_dict`` when it keeps state, registered with the trainer so
checkpoints hold it). Handlers *ask* through state flags (``skip_step``, ``should_stop``); the
trainer decides, agreeing with every data-parallel rank first.

The handler's settings are a config section declared beside it (a dataclass whose ``validate``
holds the only copy of its rules); ``compose_config`` adds it to the run config, so it loads from
YAML and dotted overrides and is validated like the shipped sections (see docs/handlers.md).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import ConfigError, Events, Trainer, check_number  # noqa: E402
from engine.data import TokenDataset, prepare_tokens, stdlib_docs_text  # noqa: E402
from engine.handler import Handler  # noqa: E402
from examples.models.gpt import GPT, GPTConfig, cross_entropy_loss  # noqa: E402
from handlers import compose_config, load_run_config  # noqa: E402


@dataclass
class LossSpikeGuardConfig:
    """The ``loss_spike_guard`` section of the run config."""

    enabled: bool = True
    factor: float = 3.0
    momentum: float = 0.9

    def validate(self, prefix: str = "loss_spike_guard") -> None:
        check_number(f"{prefix}.factor", self.factor, above=1, hint="a multiple of the running mean loss")
        check_number(f"{prefix}.momentum", self.momentum, low=0, below=1)


class LossSpikeGuard(Handler):
    """Veto the optimizer step when the loss jumps above ``factor`` x its running mean."""

    Config = LossSpikeGuardConfig
    section = "loss_spike_guard"
    state_key = "loss_spike_guard"  # its state's key in checkpoints

    def __init__(self, factor: float = 3.0, momentum: float = 0.9) -> None:
        LossSpikeGuardConfig(factor=factor, momentum=momentum).validate(prefix="LossSpikeGuard")
        self.factor, self.momentum = factor, momentum
        self.mean: float | None = None
        self.vetoed: list[int] = []

    def attach(self, trainer: Trainer) -> LossSpikeGuard:
        trainer.add_event_handler(Events.BEFORE_OPTIMIZER_STEP, self.check)
        return super().attach(trainer)  # registers it: stateful, so checkpoints hold it

    def check(self, trainer: Trainer) -> None:
        loss = trainer.state.loss
        if self.mean is not None and (not math.isfinite(loss) or loss > self.factor * self.mean):
            trainer.state.skip_step = True  # a request: every rank must agree before nobody steps
            self.vetoed.append(trainer.state.step)
            return
        self.mean = loss if self.mean is None else self.momentum * self.mean + (1 - self.momentum) * loss

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "vetoed": list(self.vetoed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.vetoed = state["mean"], list(state["vetoed"])


# The run config with the guard's section: ``loss_spike_guard.factor=2.5`` works on the command line.
ExampleConfig = compose_config(loss_spike_guard=LossSpikeGuardConfig)


def main(argv: list[str]) -> int:
    try:
        cfg = load_run_config(None, ["step_scheduler.max_steps=60", *argv], schema=ExampleConfig)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    path = Path("data/stdlib_docs.u8")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        prepare_tokens([stdlib_docs_text()], path)
    data = torch.utils.data.DataLoader(TokenDataset(path, 32), batch_size=8, shuffle=True)
    model = GPT(GPTConfig(seq_len=32, n_layers=2, d_model=64, n_heads=4))
    trainer = Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), cross_entropy_loss, grad_accum_steps=2
    )

    # 1. A plain function on a filtered event: runs on every 10th step only.
    @trainer.on(Events.STEP_END(every=10))
    def report(engine: Trainer) -> None:
        s = engine.state
        print(f"step {s.step:3d}  loss {s.loss:.3f}  grad-norm {s.grad_norm:.2f}  tokens {s.tokens_seen}")

    # 2. Priorities: higher runs earlier among the handlers of one event (default 0).
    @trainer.on(Events.STEP_END, priority=100)
    def stop_when_good_enough(engine: Trainer) -> None:
        if engine.state.loss < 2.0:
            engine.state.request_stop("loss below 2.0")

    # 3. A stateful handler class, built from its config section (None if loss_spike_guard.enabled=false).
    guard = LossSpikeGuard.from_config(cfg.loss_spike_guard)
    if guard is not None:
        guard.attach(trainer)

    state = trainer.run(data, max_steps=cfg.step_scheduler.max_steps)
    vetoed = guard.vetoed if guard is not None else []
    print(f"finished at step {state.step}; vetoed steps: {vetoed}; stop reason: {state.stop_reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
