"""``engine.step_body``: validation runs through the step body, on a bare Trainer in one process.

The local body validates with the forward it trains with; a body of the user's own (here one that
holds no outputs, as a pipeline's first stage) drives the validation without the trainer knowing
its layout."""

from types import SimpleNamespace

import pytest
import torch

from hookloop.engine import ConfigError, EvalResult, Events, LocalStepBody, Trainer
from hookloop.engine.pipeline.runtime import check_trainer_arguments


def bare_trainer(**kwargs) -> Trainer:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.functional.mse_loss,
        hang_timeout_s=None,
        **kwargs,
    )


def batches(n: int = 3) -> list:
    return [(torch.randn(2 + i, 4), torch.randn(2 + i, 2)) for i in range(n)]


def test_the_local_body_validates_with_its_training_forward():
    trainer = bare_trainer(precision="bf16-mixed")
    body = trainer.step_body
    assert isinstance(body, LocalStepBody) and body.holds_outputs
    data = batches()
    with torch.no_grad():
        items = list(body.eval_batches(data, 2, trainer.step_context))
    assert [item.samples for item in items] == [2, 3]  # at most eval_iters microbatches
    x, y = data[0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the trainer's precision
        expected = torch.nn.functional.mse_loss(trainer.model(x), y)
    assert items[0].output.dtype == torch.bfloat16 and torch.equal(items[0].loss, expected)
    assert items[0].targets is y
    assert body.share_metrics({"a": 1}) == {"a": 1}
    assert body.data_parallel_group(None) is None  # one process: its own group


def test_validate_gives_the_sample_weighted_mean_over_the_bodys_items():
    trainer = bare_trainer()
    data = batches()
    trainer.set_validation(data)
    seen = []
    trainer.add_event_handler(Events.VALIDATION_END, lambda e: seen.append(e.state.metrics["val_loss"]))
    val_loss = trainer.validate()
    with torch.no_grad():
        losses = [float(torch.nn.functional.mse_loss(trainer.model(x), y)) * len(x) for x, y in data]
    assert abs(val_loss - sum(losses) / 9) < 1e-6 and seen == [val_loss]
    assert trainer.model.training  # put back as it was


class OutputsElsewhere:
    """A body whose rank holds no outputs (a pipeline's first stage): losses only, and the metrics
    of the rank that has them."""

    holds_outputs = False

    def __init__(self, body: LocalStepBody) -> None:
        self.body = body
        self.shared = []

    def run_step(self, microbatches, ctx):
        return self.body.run_step(microbatches, ctx)

    def grad_norm(self):
        return self.body.grad_norm()

    def eval_batches(self, data, eval_iters, ctx):
        for item in self.body.eval_batches(data, eval_iters, ctx):
            yield EvalResult(item.loss, item.samples, None, item.targets)

    def share_metrics(self, metrics):
        self.shared.append(metrics)
        return {"val_from_the_last_stage": 0.5}

    def data_parallel_group(self, dp):
        return None


def test_a_body_without_the_outputs_counts_losses_and_takes_the_shared_metrics():
    trainer = bare_trainer()
    body = OutputsElsewhere(trainer.step_body)
    trainer.step_body = body
    ran = []
    trainer.evaluator.add_event_handler(Events.STEP_END, lambda e: ran.append(1))  # ITERATION_COMPLETED
    trainer.set_validation(batches())
    val_loss = trainer.validate()
    assert ran == [] and body.shared == [{}]  # the evaluator ran where the outputs are, not here
    assert trainer.state.metrics["val_from_the_last_stage"] == 0.5 and val_loss > 0


def test_a_trainer_given_a_pipeline_takes_its_microbatches_and_refuses_what_it_cannot_run():
    model = torch.nn.Linear(4, 2)
    loss = torch.nn.functional.mse_loss
    runtime = SimpleNamespace(module=model, run_step=None, n_microbatches=4, loss_fn=None)
    assert check_trainer_arguments(runtime, model, loss, 1, "fp32", False) == 4
    assert runtime.loss_fn is loss  # the stages take the trainer's loss
    refused = [
        ((runtime, model, loss, 3, "fp32", False), "grad_accum_steps"),
        ((runtime, model, loss, 4, "fp16-mixed", False), "precision"),
        ((runtime, model, loss, 4, "bf16-mixed", True), "loss_parallel"),
    ]
    for args, field in refused:
        with pytest.raises(ConfigError) as caught:
            check_trainer_arguments(*args)
        assert caught.value.field == field
    with pytest.raises(ValueError, match="must be runtime.module"):
        check_trainer_arguments(runtime, torch.nn.Linear(4, 2), loss, 1, "fp32", False)
    with pytest.raises(TypeError, match="pipeline must be the runtime"):
        check_trainer_arguments(object(), model, loss, 1, "fp32", False)
