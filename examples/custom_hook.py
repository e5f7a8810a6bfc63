"""Writing your own hooks: a function on an event, a filtered event, and a stateful handler class.

    python examples/custom_hook.py

A handler is any callable attached to an event; a reusable one is a class with ``attach(trainer)``
(and ``state_dict``/``load_state_dict`` when it keeps state, registered with the trainer so
checkpoints hold it). Handlers *ask* through state flags (``skip_step``, ``should_stop``); the
trainer decides, agreeing with every data-parallel rank first.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Events, Trainer  # noqa: E402
from engine.data import TokenDataset, prepare_tokens, stdlib_docs_text  # noqa: E402
from examples.models.gpt import GPT, GPTConfig, cross_entropy_loss  # noqa: E402


class LossSpikeGuard:
    """Veto the optimizer step when the loss jumps above ``factor`` x its running mean."""

    def __init__(self, factor: float = 3.0, momentum: float = 0.9) -> None:
        self.factor, self.momentum = factor, momentum
        self.mean: float | None = None
        self.vetoed: list[int] = []

    def attach(self, trainer: Trainer) -> None:
        trainer.add_event_handler(Events.BEFORE_OPTIMIZER_STEP, self.check)
        trainer.register_stateful("loss_spike_guard", self)  # saved and restored with checkpoints

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


def main() -> None:
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

    # 3. A stateful handler class.
    guard = LossSpikeGuard()
    guard.attach(trainer)

    state = trainer.run(data, max_steps=60)
    print(f"finished at step {state.step}; vetoed steps: {guard.vetoed}; stop reason: {state.stop_reason}")


if __name__ == "__main__":
    main()
