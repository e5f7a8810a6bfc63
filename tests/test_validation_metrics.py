"""Validation metrics (``validation.metrics`` / ``set_validation(metrics=...)``): published as
``val_<name>`` beside ``val_loss``, reduced over the data-parallel ranks only, the same value in one
process and under DDP, tensor and pipeline parallelism; the config section, its checks, logging and
``checkpoint.metric``."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from ignite.metrics import Accuracy, Metric

from hookloop.engine import ConfigError, Events, TokenAccuracy, Trainer
from hookloop.engine.validation import ValidationConfig, build_metrics
from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss
from hookloop.train import load_training_config
from tests.cadence import validate_every
from tests.dist_utils import REPO, run_distributed, run_process, run_torchrun

SEQ = 8


def _token_batches(n: int, batch: int = 2, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 16, (n * batch, SEQ + 1), generator=g)
    return [(x[i : i + batch, :-1], x[i : i + batch, 1:]) for i in range(0, n * batch, batch)]


def _gpt_trainer() -> Trainer:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, seq_len=SEQ, n_layers=1, d_model=16, n_heads=2))
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cross_entropy_loss)


# ---------------------------------------------------------------------------- one process


def test_set_validation_counts_no_steps_and_every_steps_names_its_replacement():
    trainer = _gpt_trainer()
    with pytest.raises(ConfigError, match=r"the step scheduler's val_every_steps=N") as info:
        trainer.set_validation(_token_batches(1), every_steps=2)
    assert "trainer.control.request_validate()" in str(info.value)
    trainer.set_validation(_token_batches(1))
    seen = []
    trainer.add_event_handler(Events.VALIDATION_END, lambda: seen.append(trainer.state.step))
    trainer.run(_token_batches(8), max_steps=4)
    assert seen == []  # nobody asked: the validator validates only when the control point decided it


def test_metrics_are_published_as_val_names_before_validation_end_and_equal_ignite_on_the_same_samples():
    trainer = _gpt_trainer()
    val = _token_batches(3, seed=5)
    trainer.set_validation(
        val,
        metrics={
            "accuracy": TokenAccuracy(),
            # ignite's own Accuracy wants classes on dim 1: an output_transform reshapes the logits
            "ignite_accuracy": Accuracy(output_transform=lambda o: (o[0].transpose(1, 2), o[1])),
        },
    )
    validate_every(trainer, 2)
    seen = []
    trainer.add_event_handler(Events.VALIDATION_END, lambda: seen.append(dict(trainer.state.metrics)))
    trainer.run(_token_batches(8), max_steps=4)
    assert [sorted(m) for m in seen] == [["val_accuracy", "val_ignite_accuracy", "val_loss"]] * 2

    # the same samples by hand, with the trained model
    model = trainer.model.eval()
    with torch.no_grad():
        logits = torch.cat([model(x) for x, _ in val])
    targets = torch.cat([y for _, y in val])
    expected = (logits.argmax(-1) == targets).double().mean().item()
    assert 0 < expected < 1
    assert seen[-1]["val_accuracy"] == pytest.approx(expected, abs=1e-12)
    assert seen[-1]["val_ignite_accuracy"] == pytest.approx(expected, abs=1e-12)
    assert trainer.validate() == pytest.approx(seen[-1]["val_loss"])
    assert trainer.state.metrics["val_accuracy"] == seen[-1]["val_accuracy"]


def test_token_accuracy_grades_only_labelled_positions_and_shifts_hugging_face_labels():
    logits = torch.zeros(1, 4, 5)
    logits[0, torch.arange(4), torch.tensor([1, 2, 3, 4])] = 1.0  # predicts 1, 2, 3, 4
    metric = TokenAccuracy()
    metric.update((logits, torch.tensor([[1, 0, 3, -100]])))  # right, wrong, right, ungraded
    assert metric.compute() == pytest.approx(2 / 3)
    shifted = TokenAccuracy(shift_labels=True)  # labels are the inputs: position t predicts t + 1
    shifted.update(({"logits": logits}, torch.tensor([[0, 1, 0, 3]])))  # 1, 2, 3 against 1, 0, 3
    assert shifted.compute() == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match=r"logits \[batch, seq, vocab\]"):
        metric.update((torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long)))


def test_set_validation_refuses_what_is_not_a_metric_and_names_that_do_not_fit():
    trainer = _gpt_trainer()
    with pytest.raises(TypeError, match=r"metrics\['acc'\] must be an ignite Metric"):
        trainer.set_validation([], metrics={"acc": lambda o: 0.0})
    with pytest.raises(ConfigError, match="'loss' is taken"):
        trainer.set_validation([], metrics={"loss": Accuracy()})
    with pytest.raises(ConfigError, match="letters, digits and underscores"):
        trainer.set_validation([], metrics={"top/5": Accuracy()})
    shared = Accuracy()
    with pytest.raises(ValueError, match="its own instance"):
        trainer.set_validation([], metrics={"a": shared, "b": shared})


def test_setting_validation_again_replaces_the_metrics_on_the_evaluator():
    trainer = _gpt_trainer()
    first = TokenAccuracy()
    trainer.set_validation(_token_batches(2), metrics={"first": first})
    trainer.set_validation(_token_batches(2), metrics={"second": TokenAccuracy()})
    assert not first.is_attached(trainer.evaluator)
    trainer.validate()
    assert "val_second" in trainer.state.metrics and "val_first" not in trainer.state.metrics


MY_METRICS = """
import torch
from ignite.metrics.metric import Metric, reinit__is_reduced, sync_all_reduce


class SamplesSeen(Metric):
    '''Validation samples counted, summed over the data-parallel ranks: a world-wide sum would
    count a sample once per tensor-parallel rank.'''

    @reinit__is_reduced
    def reset(self):
        self._n = torch.zeros((), dtype=torch.long)

    @reinit__is_reduced
    def update(self, output):
        self._n += output[1].shape[0]

    @sync_all_reduce("_n")
    def compute(self):
        return int(self._n)


def build(scale: int = 1):
    return SamplesSeen(output_transform=lambda o: (o[0], o[1][: max(1, len(o[1]) // scale)]))


NOT_A_METRIC = 3


def not_a_metric_factory():
    return "accuracy"
"""


@pytest.fixture
def my_metrics(tmp_path, monkeypatch):
    (tmp_path / "my_metrics.py").write_text(MY_METRICS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_section_loads_from_yaml_and_overrides_and_builds_its_metrics(my_metrics):
    (my_metrics / "run.yaml").write_text(
        "step_scheduler:\n  max_steps: 10\n"
        "validation:\n  metrics:\n    accuracy: hookloop.engine:TokenAccuracy\n"
        "    top: {target: hookloop.engine:TokenAccuracy, ignore_index: 0}\n"
    )
    cfg = load_training_config("run.yaml", ["validation.metrics.samples=my_metrics.py:build"])
    assert cfg.validation.metrics == {
        "accuracy": "hookloop.engine:TokenAccuracy",
        "top": {"target": "hookloop.engine:TokenAccuracy", "ignore_index": 0},
        "samples": "my_metrics.py:build",
    }
    built = build_metrics(cfg.validation)
    assert list(built) == ["accuracy", "top", "samples"]
    assert isinstance(built["top"], TokenAccuracy) and built["top"].ignore_index == 0
    assert isinstance(built["samples"], Metric)
    more = load_training_config("run.yaml", ["validation.metrics.top.shift_labels=true"])
    assert build_metrics(more.validation)["top"].shift_labels is True


@pytest.mark.parametrize(
    ("metrics", "field", "words"),
    [
        ({"acc": "ignite.metrics:Nope"}, "validation.metrics.acc.target", "has no attribute 'Nope'"),
        ({"acc": "Accuracy"}, "validation.metrics.acc.target", "must look like module:attribute"),
        ({"acc": "my_metrics.py:NOT_A_METRIC"}, "validation.metrics.acc.target", "name an ignite Metric"),
        ({"acc": "torch.nn:Linear"}, "validation.metrics.acc.target", "not an ignite Metric"),
        ({"acc": "my_metrics.py:not_a_metric_factory"}, "validation.metrics.acc.target", "returned str"),
        ({"acc": {"target": "my_metrics.py:build", "sc": 2}}, "validation.metrics.acc.sc", "takes: scale"),
        ({"acc": {"k": 5}}, "validation.metrics.acc.target", "is not set"),
        ({"acc": 5}, "validation.metrics.acc", "must be a target"),
        ({"val-acc": "hookloop.engine:TokenAccuracy"}, "validation.metrics.val-acc", "underscores"),
        (
            {"acc": {"target": "hookloop.engine:TokenAccuracy", "shift_labels": 3}},
            "validation.metrics.acc.shift_labels",
            "takes shift_labels: bool",
        ),
    ],
)  # fmt: skip
def test_bad_metric_settings_are_config_errors_naming_the_field(my_metrics, metrics, field, words):
    section = ValidationConfig(metrics=metrics)
    with pytest.raises(ConfigError) as caught:
        section.validate("validation")
        build_metrics(section)
    assert caught.value.field == field and words in str(caught.value)


def test_configured_metrics_count_as_produced_for_keep_best(my_metrics):
    validating = [
        "step_scheduler.max_steps=10",
        "step_scheduler.val_every_steps=5",
        "checkpoint.keep_best=2",
        "checkpoint.metric_mode=max",
    ]
    acc = "validation.metrics.acc=hookloop.engine:TokenAccuracy"
    cfg = load_training_config(None, [*validating, acc, "checkpoint.metric=val_acc"])
    assert {"val_loss", "val_acc"} <= cfg.produced_metrics()
    with pytest.raises(ConfigError) as caught:
        load_training_config(None, [*validating, "checkpoint.metric=val_acc"])
    assert caught.value.field == "checkpoint.metric" and "validation.metrics" in str(caught.value)


# ---------------------------------------------------------------------------- the reduction


def _reduction_worker(rank: int, world: int) -> dict:
    """dp 2 x tp 2 without a model: each data-parallel rank sees its own shard, both ranks of a
    tensor-parallel group the same one; then one 'last stage' computes alone, as a pipeline's does."""
    import torch.distributed as dist
    from ignite.metrics import EpochMetric

    from hookloop.engine import init_distributed
    from hookloop.engine.ignite_adapter import ignite_world
    from hookloop.engine.parallel import data_parallel_group

    info = init_distributed("gloo", tp_size=2)
    dp_rank, tp_rank = info.dim_rank("dp"), info.dim_rank("tp")
    g = torch.Generator().manual_seed(7)
    logits, targets = torch.randn(2, 6, 4, generator=g), torch.randint(0, 4, (2, 6), generator=g)

    def shard_metrics() -> dict:
        # a sum-reduced metric, and one that all-gathers, computes on rank 0 and broadcasts
        acc, correct = TokenAccuracy(), EpochMetric(lambda p, y: float((p.argmax(-1) == y).sum()))
        acc.update((logits[dp_rank : dp_rank + 1], targets[dp_rank : dp_rank + 1]))
        correct.update((logits[dp_rank].reshape(-1, 4), targets[dp_rank].reshape(-1)))
        return {"acc": acc, "correct": correct}

    whole = TokenAccuracy()
    whole.update((logits, targets))
    out = {"single": whole.compute(), "single_correct": float((logits.argmax(-1) == targets).sum())}
    for way, group in (
        ("mesh", data_parallel_group(info.mesh_dim("dp"))),
        ("found", data_parallel_group(positions=(info.dim_rank("pp"), tp_rank))),
    ):
        metrics = shard_metrics()
        with ignite_world(group):
            out[way] = {name: metric.compute() for name, metric in metrics.items()}
    if tp_rank == 1:  # only these ranks compute: their data-parallel peers reduce among themselves
        with ignite_world(data_parallel_group(info.mesh_dim("dp"))):
            out["last_stage"] = shard_metrics()["acc"].compute()
    # ignite's default, a world-wide reduction: every sample counted once per tensor-parallel rank
    out["world_correct"] = shard_metrics()["correct"].compute()
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.distributed
def test_metrics_reduce_over_the_data_parallel_ranks_only():
    results = run_distributed(_reduction_worker, 4)
    single, correct = results[0]["single"], results[0]["single_correct"]
    assert 0 < single < 1
    for rank, out in enumerate(results):
        for way in ("mesh", "found"):
            assert out[way] == {"acc": pytest.approx(single, abs=1e-12), "correct": correct}, (rank, way)
        assert ("last_stage" in out) == (rank % 2 == 1)
        assert out.get("last_stage", single) == pytest.approx(single, abs=1e-12)
        assert out["world_correct"] == 2 * correct


# ---------------------------------------------------------------------------- every layout, end to end

RUN = [
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=2",
    "train.seq_len=16",
    "train.local_batch_size=2",
    "step_scheduler.global_batch_size=4",
    "step_scheduler.max_steps=6",
    "step_scheduler.val_every_steps=3",
    "step_scheduler.ckpt_every_steps=3",
    "data.val_samples=8",
    "lr.warmup_steps=1",
    "optimizer.lr=0.01",
    "logging.log_interval=3",
    "validation.metrics.accuracy=hookloop.engine:TokenAccuracy",
    "validation.metrics.samples=my_metrics.py:build",
    "checkpoint.keep_last=1",
    "checkpoint.keep_best=1",
    "checkpoint.metric=val_accuracy",
    "checkpoint.metric_mode=max",
]
LAYOUTS = {"ddp2": [], "tp2": ["distributed.tp_size=2"], "pp2": ["distributed.pp_size=2"]}


def _validations(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("val_")} for r in rows if "val_loss" in r}


@pytest.mark.distributed
@pytest.mark.slow
def test_hookloop_train_publishes_the_same_metrics_in_one_process_and_under_ddp_tp_and_pp(my_metrics):
    """One process, then 2 ranks as DDP, tensor parallel and pipeline parallel: the same 8
    validation samples give the same ``val_accuracy`` and ``val_samples`` (8: counted once, not once
    per tensor-parallel rank) in ``metrics.jsonl``, on the console and in TensorBoard, and
    ``checkpoint.keep_best`` keeps the checkpoint with the best accuracy."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = str(REPO / "examples" / "configs" / "gpt_tiny.yaml")

    def args(run: str) -> list[str]:
        return [
            "train",
            config,
            f"train.run_dir={my_metrics / run}",
            f"data.cache_dir={my_metrics / 'cache'}",
            *RUN,
        ]

    one = run_process(
        [sys.executable, "-m", "hookloop", *args("one"), "logging.tensorboard=true"],
        cwd=my_metrics,
        timeout=240,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    expected = _validations(my_metrics / "one")
    assert sorted(expected) == [3, 6]
    for step, metrics in expected.items():
        assert sorted(metrics) == ["val_accuracy", "val_loss", "val_samples"]
        assert metrics["val_samples"] == 8 and 0 < metrics["val_accuracy"] < 1, step
        assert (
            f"step {step}/6 | " in one.stdout
            and f"val_accuracy {metrics['val_accuracy']:.4f} | val_samples 8" in one.stdout
        )

    board = EventAccumulator(str(my_metrics / "one" / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    logged = {e.step: e.value for e in board.Scalars("val/accuracy")}
    assert logged == {s: pytest.approx(m["val_accuracy"], rel=1e-6) for s, m in expected.items()}

    # keep_last=1 plus the best by val_accuracy (max): step 6, and step 3 only if it was better
    kept = sorted(int(p.name.split("_")[1]) for p in (my_metrics / "one" / "checkpoints").glob("step_*"))
    best = max(expected, key=lambda s: (expected[s]["val_accuracy"], -s))
    assert kept == sorted({6, best})
    marker = json.loads((my_metrics / "one" / "checkpoints" / f"step_{best:08d}" / ".complete").read_text())
    assert marker["metrics"] == {"val_accuracy": expected[best]["val_accuracy"]}

    for layout, extra in LAYOUTS.items():
        proc = run_torchrun("hookloop", 2, [*args(layout), *extra], module=True, cwd=my_metrics)
        assert proc.returncode == 0, (layout, proc.stderr[-3000:])
        got = _validations(my_metrics / layout)
        assert sorted(got) == [3, 6], layout
        for step, metrics in got.items():
            assert metrics["val_samples"] == 8, (layout, step)
            assert metrics["val_accuracy"] == pytest.approx(expected[step]["val_accuracy"], abs=1e-12), (
                layout,
                step,
            )
            assert metrics["val_loss"] == pytest.approx(expected[step]["val_loss"], rel=1e-4), (layout, step)
