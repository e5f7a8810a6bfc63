"""``engine.step_body``: validation runs through the step body, on a bare Trainer in one process.

The local body validates with the forward it trains with; a body of the user's own (here one that
holds no outputs, as a pipeline's first stage) drives the validation without the trainer knowing
its layout. ``Trainer(step_body=...)`` trains and validates through the body it is given (a
``LocalStepBody`` subclass overriding ``compute_loss``, or a class of its own) and refuses, naming
the argument and the fix, what it cannot run; a body's ``run_step`` result is checked in the step
that returned it (in a real ``hookloop train`` process that saves checkpoints)."""

import json
import sys

import pytest
import torch

from hookloop.engine import ConfigError, EvalResult, Events, LocalStepBody, StepBody, StepResult, Trainer
from hookloop.engine.pipeline import PipelineRuntime
from tests.dist_utils import run_process
from tests.user_models import tiny_lm_config, tiny_lm_source


def bare_trainer(body_for=None, **kwargs) -> Trainer:
    """A trainer over a seeded Linear(4, 2); ``body_for(model)`` gives its step body, if any."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.functional.mse_loss,
        hang_timeout_s=None,
        step_body=body_for(model) if body_for is not None else None,
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


def fake_runtime(model, n_microbatches: int = 4, loss_fn=None) -> PipelineRuntime:
    """A pipeline runtime without stages: what a Trainer checks before it would run one."""
    runtime = PipelineRuntime.__new__(PipelineRuntime)
    runtime.module, runtime.n_microbatches, runtime.loss_fn = model, n_microbatches, loss_fn
    return runtime


def test_a_trainer_given_a_pipeline_takes_its_microbatches_and_refuses_what_it_cannot_run():
    model = torch.nn.Linear(4, 2)
    loss = torch.nn.functional.mse_loss

    def trainer(runtime, module=model, **kwargs):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return Trainer(module, optimizer, loss, hang_timeout_s=None, step_body=runtime, **kwargs)

    runtime = fake_runtime(model)
    assert trainer(runtime).grad_accum_steps == 4  # the body's declaration
    assert runtime.loss_fn is loss  # the stages take the trainer's loss
    refused = [
        ({"grad_accum_steps": 3}, "grad_accum_steps"),
        ({"precision": "fp16-mixed"}, "precision"),
        ({"precision": "bf16-mixed", "loss_parallel": True}, "loss_parallel"),
    ]
    for kwargs, field in refused:
        with pytest.raises(ConfigError) as caught:
            trainer(fake_runtime(model), **kwargs)
        assert caught.value.field == field
    with pytest.raises(ValueError, match="must be runtime.module"):
        trainer(fake_runtime(model), module=torch.nn.Linear(4, 2))
    with pytest.raises(TypeError, match=r"Trainer\(pipeline=...\) is now Trainer\(step_body=...\)"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, pipeline=fake_runtime(model))


# ------------------------------------------------------------------ Trainer(step_body=...)


class Scaled(LocalStepBody):
    """A step of the user's own: the loss times 3 in training, plain in validation."""

    def compute_loss(self, inputs, targets, ctx):
        output = self.model(inputs)
        loss = ctx.loss_fn(output, targets)
        return output, (loss if not self.model.training else 3 * loss)


def test_a_local_body_subclass_trains_on_its_own_loss_and_validates_through_its_eval_path():
    data = batches(4)
    plain, scaled = bare_trainer(), bare_trainer(Scaled)
    assert scaled.step_body.params == scaled._params  # the trainer's parameters: clipped and stepped
    for trainer in (plain, scaled):
        trainer.set_validation(data)
    losses = {}
    for name, trainer in (("plain", plain), ("scaled", scaled)):
        trainer.add_event_handler(
            Events.MICROBATCH, lambda e, n=name: losses.setdefault(n, e.state.microbatch_loss)
        )
        trainer.run(data[:1], max_steps=1)
    assert losses["scaled"] == pytest.approx(3 * losses["plain"], rel=1e-6)  # the body's loss
    # the same first step on 3x the loss moves the weights 3x as far (both start from seed 0)
    torch.manual_seed(0)
    w0 = torch.nn.Linear(4, 2).weight.detach()
    assert torch.allclose(scaled.model.weight - w0, 3 * (plain.model.weight - w0), atol=1e-6)
    # validation: the body's eval path (no factor 3), on the model as it is now
    with torch.no_grad():
        expected = sum(float(torch.nn.functional.mse_loss(scaled.model(x), y)) * len(x) for x, y in data)
    assert scaled.validate() == pytest.approx(expected / sum(len(x) for x, _ in data), rel=1e-6)


def test_a_body_of_its_own_class_is_used_for_training_and_validation():
    trainer = bare_trainer()
    body = OutputsElsewhere(LocalStepBody(trainer.model))
    model = trainer.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = Trainer(model, optimizer, torch.nn.functional.mse_loss, hang_timeout_s=None, step_body=body)
    assert other.step_body is body
    other.set_validation(batches())
    state = other.run(batches(2), max_steps=2)
    assert state.step == 2 and body.shared == [] and other.validate() > 0 and body.shared == [{}]


def test_a_step_body_missing_protocol_members_is_refused_naming_them():
    class Half:
        holds_outputs = True

        def run_step(self, microbatches, ctx): ...

        grad_norm = 0.0  # not callable

    class NoStep(StepBody):  # the defaults cover everything but the step
        grad_norm = 0.0

    for body, words in (
        (Half(), ["missing eval_batches, share_metrics, data_parallel_group", "not callable: grad_norm"]),
        (object(), ["missing run_step, grad_norm, holds_outputs"]),
        (NoStep(), ["missing run_step; not callable: grad_norm"]),
    ):
        with pytest.raises(TypeError) as refused:
            bare_trainer(lambda model, body=body: body)
        message = str(refused.value)
        assert message.startswith("step_body (") and all(w in message for w in words), message
        assert "Subclass hookloop.engine.StepBody and implement run_step" in message


def test_a_step_body_class_instead_of_an_instance_is_refused():
    with pytest.raises(
        TypeError, match=r"got the class Scaled; pass an instance, e.g. step_body=Scaled\(model"
    ):
        bare_trainer(lambda model: Scaled)


def test_a_local_body_over_another_module_is_refused():
    with pytest.raises(ValueError, match="runs another module than the Trainer's model: build the body over"):
        bare_trainer(lambda model: Scaled(torch.nn.Linear(4, 2)))


class FromScratch(StepBody):
    """A body written from scratch: the step only (forward, loss, backward per microbatch); the
    gradient norm, validation and the layout are the trainer's defaults."""

    def run_step(self, microbatches, ctx) -> StepResult:
        total = 0.0
        for i, microbatch in enumerate(microbatches):
            inputs, targets = ctx.prepare(microbatch)
            output = self.model(inputs)
            loss = ctx.loss_fn(output, targets)
            (loss / len(microbatches)).backward()
            total += loss.detach()
            ctx.microbatch_done(i, loss.detach(), output, targets)
        return StepResult(total / len(microbatches), 0, sum(len(mb[0]) for mb in microbatches))


def test_a_body_from_scratch_implementing_only_run_step_trains_and_validates():
    data = batches(4)
    plain, scratch = (
        bare_trainer(grad_accum_steps=2),
        bare_trainer(lambda model: FromScratch(), grad_accum_steps=2),
    )
    body = scratch.step_body
    assert isinstance(body, FromScratch) and body.model is scratch.model and body.params == scratch._params
    for trainer in (plain, scratch):
        trainer.set_validation(data)
        trainer.run(data, max_steps=2)
    assert scratch.state.step == 2 and scratch.state.samples_seen == plain.state.samples_seen
    assert scratch.state.grad_norm == pytest.approx(plain.state.grad_norm, rel=1e-6)  # the default norm
    assert torch.allclose(scratch.model.weight, plain.model.weight, atol=1e-6)  # the same two steps
    assert scratch.validate() == pytest.approx(plain.validate(), rel=1e-6)  # the default validation


def test_fp16_loss_scaling_needs_a_body_that_scales_its_loss():
    trainer = bare_trainer(Scaled, precision="fp16-mixed")  # a LocalStepBody scales: it gets the scaler
    assert trainer.step_body.grad_scaler is trainer.grad_scaler is not None
    with pytest.raises(ConfigError) as refused:
        bare_trainer(lambda model: OutputsElsewhere(LocalStepBody(model)), precision="fp16-mixed")
    assert refused.value.field == "precision" and "subclass hookloop.engine.LocalStepBody" in str(
        refused.value
    )


def test_compute_loss_must_return_an_output_and_a_scalar_loss():
    class LossOnly(LocalStepBody):
        def compute_loss(self, inputs, targets, ctx):
            return ctx.loss_fn(self.model(inputs), targets)

    class PerSample(LocalStepBody):
        def compute_loss(self, inputs, targets, ctx):
            output = self.model(inputs)
            return output, ((output - targets) ** 2).mean(1)

    for body, message in (
        (LossOnly, r"LossOnly.compute_loss must return a pair \(output, loss\), got Tensor"),
        (
            PerSample,
            r"PerSample.compute_loss must return \(output, loss\) with the loss a scalar tensor, got \(2,\)",
        ),
    ):
        trainer = bare_trainer(body)
        with pytest.raises(ValueError, match=message):
            trainer.run(batches(1), max_steps=1)


# ------------------------------------------------------------------ a body's result, checked where returned
BODIES = '''
import torch

from hookloop.engine import StepResult


class Returns:
    """Wraps the run's step body; from step ``at`` on, run_step returns ``what`` after the real step."""

    def __init__(self, body, at, what):
        self.body, self.at, self.what, self.steps = body, at, what, 0

    def __getattr__(self, name):
        return getattr(self.body, name)

    def run_step(self, microbatches, ctx):
        result = self.body.run_step(microbatches, ctx)
        self.steps += 1
        if self.steps < self.at:
            return result
        return {"none": None, "str": StepResult("0.5", result.tokens, result.samples),
                "int": StepResult(torch.tensor(1), result.tokens, result.samples)}[self.what]


class Swap:
    """A handler that gives the trainer the body above (a config's way to a step body of its own)."""

    def __init__(self, at: int, what: str):
        self.at, self.what = at, what

    def attach(self, trainer):
        trainer.step_body = Returns(trainer.step_body, self.at, self.what)
'''


@pytest.mark.parametrize(
    ("what", "got"),
    [
        ("none", "got None"),
        ("str", "got a StepResult whose loss is a str '0.5'"),
        ("int", "got a StepResult whose loss is a torch.int64 tensor of shape ()"),
    ],
)
def test_a_run_step_returning_no_step_result_fails_that_step_naming_the_body(tmp_path, what, got):
    (tmp_path / "my_models.py").write_text(tiny_lm_source(seq_len=8))
    (tmp_path / "bodies.py").write_text(BODIES)
    (tmp_path / "run.yaml").write_text(
        tiny_lm_config(max_steps=6, ckpt_every_steps=1) + "data:\n  cache_dir: data\n"
    )
    swap = f"handlers=[{{target: 'bodies.py:Swap', at: 4, what: {what}}}]"
    proc = run_process(
        [sys.executable, "-m", "hookloop", "train", "run.yaml", swap], cwd=tmp_path, timeout=180
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = (
        "Returns.run_step must return a StepResult(loss, tokens, samples) with the loss a 0-dim floating "
        f"tensor (this rank's mean loss), {got}"
    )
    assert f"TypeError: {said}" in proc.stderr, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "run"
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status["step"] == 4, status  # the step that returned it
    assert status["reason"] == f"TypeError: {said}", status
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert not [name for name in saved if ".partial-" in name], saved
    assert "step_00000003" in saved, saved
