"""AsyncCheckpointer: exact resume (1 process, DDP, FSDP2), resharding, crash safety, rollback, errors.

Every comparison is bitwise and made at one thread count with deterministic algorithms.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import shutil
import signal
import sys
import time

import numpy as np
import pytest
import torch

from hookloop.engine import ConfigError, Events, ExitCode, Priority, Trainer
from hookloop.engine.checkpoint_format.directory import (
    MARKER,
    complete_checkpoints,
    is_complete,
    read_json,
    read_latest,
    step_dir_name,
)
from hookloop.engine.checkpoint_format.safe_read import SafeReader
from hookloop.handlers import load_run_config
from hookloop.handlers.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    CheckpointLayoutError,
    describe_layout_difference,
)
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every
from tests.conftest import tiny_gpt, token_batches
from tests.dist_utils import REPO, from_numpy, full_snapshot, run_distributed, run_process, to_numpy
from tests.forked import start_forked
from tests.scripts import ckpt_train

MODES = ("sync", "async_copy", "async")


pytestmark = pytest.mark.usefixtures("deterministic")


def noisy_prepare(microbatch, device):
    """Uses python, numpy and torch RNG, so a resume that restores any of them wrongly diverges."""
    x, y = microbatch
    keep = torch.rand(x.shape) < 0.9
    shift = random.randint(0, 3) + int(np.random.randint(0, 3))
    return torch.where(keep, (x + shift) % 64, 0).to(device), y.to(device)


def make_trainer(seed: int = 0, **kwargs) -> Trainer:
    model = tiny_gpt(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    kwargs.setdefault("grad_accum_steps", 2)
    return Trainer(
        model, optimizer, cross_entropy_loss, lr_scheduler=scheduler, prepare_batch=noisy_prepare, **kwargs
    )


def shuffled_loader(n: int = 10) -> torch.utils.data.DataLoader:
    pairs = [(x[0], y[0]) for x, y in token_batches(n, batch=1, seed=3)]
    return torch.utils.data.DataLoader(
        pairs, batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(7)
    )


def seed_all(seed: int = 11) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    for i, s in enumerate(trainer.optimizer.state.values()):
        out.update({f"o.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return out


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"not bitwise equal: {different[:5]}"


def stop_at(trainer: Trainer, step: int) -> None:
    """What a stop signal does through the StepScheduler: stop (resumable) after ``step``."""

    def request(engine: Trainer) -> None:
        if engine.state.step == step:
            engine.control.request_save()
            engine.control.request_stop("test stop", ExitCode.STOPPED)

    trainer.add_event_handler(Events.STEP_END, request, priority=Priority.DECIDE)


# ------------------------------------------------------------------------------ single process
@pytest.mark.parametrize(
    ("mode", "stop"), [("sync", 4), ("async", 7), ("async_copy", 5), ("sync", 5), ("async_copy", 7)]
)
def test_stop_and_resume_is_bitwise_equal_to_uninterrupted(tmp_path, mode, stop):
    """10 microbatches, 2 per step: 5 steps per epoch; stops mid-epoch (7), at an epoch end (5) and
    in the first epoch (4). Data is a shuffled DataLoader reshuffling from its generator."""
    seed_all()
    ref = make_trainer()
    ref.run(shuffled_loader(), max_steps=12)
    expected = snapshot(ref)

    seed_all()
    first = make_trainer()
    saved = []
    AsyncCheckpointer(tmp_path, mode=mode).attach(first)
    save_every(first, 3)
    first.add_event_handler(Events.CHECKPOINT_SAVED, lambda _e, step=None, path=None: saved.append(step))
    stop_at(first, stop)
    state = first.run(shuffled_loader(), max_steps=12)
    assert state.step == stop and state.control.exit_code == ExitCode.STOPPED
    assert saved == sorted({3, 6, stop} & set(range(1, stop + 1)))
    assert read_latest(tmp_path) == step_dir_name(stop)

    seed_all(99)  # a different process would start from other RNG states
    second = make_trainer(seed=5)
    checkpointer = AsyncCheckpointer(tmp_path, mode=mode).attach(second)
    save_every(second, 3)
    second.run(shuffled_loader(), max_steps=12)
    assert checkpointer.resumed_from == os.path.join(tmp_path, step_dir_name(stop))
    assert (second.state.step, second.state.epoch) == (ref.state.step, ref.state.epoch)
    assert second.state.tokens_seen == ref.state.tokens_seen
    assert second.lr_scheduler.state_dict() == ref.lr_scheduler.state_dict()
    assert_bitwise(snapshot(second), expected)


def test_the_last_step_save_follows_the_runs_own_step_limit(tmp_path):
    """The checkpointer saves at the run's last step by :attr:`Trainer.at_last_step`: the limit this
    run was given, not a trainer-wide ``max_steps`` default it overrides (every step past that
    default is not a last step)."""
    trainer = make_trainer()
    trainer.max_steps = 2  # the default for runs that pass no limit; this run passes its own
    saved = []
    AsyncCheckpointer(tmp_path, mode="sync").attach(trainer)
    trainer.add_event_handler(Events.CHECKPOINT_SAVED, lambda _e, step=None, path=None: saved.append(step))
    state = trainer.run(shuffled_loader(), max_steps=5)
    assert state.step == 5 and saved == [5]
    assert read_latest(tmp_path) == step_dir_name(5)


class CountingSource:
    """A stateful iterable: restores its position in O(1) and counts what it fetches."""

    def __init__(self, items: list) -> None:
        self.items, self.pos, self.fetched = items, 0, 0

    def __iter__(self):
        while self.pos < len(self.items):
            self.pos += 1
            self.fetched += 1
            yield self.items[self.pos - 1]
        self.pos = 0

    def __len__(self) -> int:
        return len(self.items)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


class Stream:
    """A plain iterable without a length: resume replays it (O(n))."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_resume_positions_stateful_source_in_o1_and_plain_iterable_by_replay(tmp_path, kind):
    items = token_batches(8)
    wrap = CountingSource if kind == "stateful" else Stream
    seed_all()
    ref = make_trainer()
    ref.run(wrap(items), max_steps=7)

    seed_all()
    first = make_trainer()
    AsyncCheckpointer(tmp_path, mode="sync").attach(first)
    stop_at(first, 6)  # 4 steps per epoch: mid second epoch
    first.run(wrap(items), max_steps=7)

    second = make_trainer(seed=3)
    AsyncCheckpointer(tmp_path, mode="sync").attach(second)
    source = wrap(items)
    seen = []
    second.add_event_handler(Events.STEP_START, lambda e: seen.append(e.state.batch))
    second.run(source, max_steps=7)
    assert_bitwise(snapshot(second), snapshot(ref))
    assert (
        len(seen) == 1
        and [torch.equal(mb[0], item[0]) for mb, item in zip(seen[0], items[4:6])] == [True] * 2
    )
    if kind == "stateful":
        assert source.fetched == 2  # only step 7's microbatches; nothing replayed
    assert (second.state.step, second.state.epoch) == (7, 2)


def test_latest_moves_only_after_the_save_is_durable_and_pruning_keeps_last(tmp_path):
    trainer = make_trainer()
    checkpointer = AsyncCheckpointer(tmp_path, mode="async", keep_last=2).attach(trainer)
    save_every(trainer, 1)
    observed = []

    @trainer.on(Events.STEP_END, priority=-10)
    def _look(engine):
        step = engine.state.step
        if checkpointer.saving and checkpointer.last_saved_step == step:  # this step's save started
            (partial,) = tmp_path.glob(f"{step_dir_name(step)}.partial-*")
            observed.append((step, read_latest(tmp_path), is_complete(partial)))

    trainer.run(token_batches(12), max_steps=6)
    for step, latest, complete in observed:
        assert latest != step_dir_name(step) and not complete
    assert len(observed) == 6
    complete, torn = complete_checkpoints(tmp_path)
    assert [s for s, _ in complete] == [6, 5] and not torn
    assert read_latest(tmp_path) == step_dir_name(6)
    assert not [n for n in os.listdir(tmp_path) if "partial" in n]
    # a requeued job that already reached max_steps trains nothing more
    again = make_trainer(seed=2)
    AsyncCheckpointer(tmp_path, mode="async").attach(again)
    again.run(token_batches(12), max_steps=6)
    assert again.state.step == 6
    assert_bitwise(snapshot(again), snapshot(trainer))


def test_pruning_touches_nothing_outside_the_directory_and_leaves_nothing_behind(tmp_path):
    """Step directories that are symbolic links to checkpoints elsewhere (complete ones the run
    resumes past, a torn one, one a new save of the same step replaces) and stale ``.pruned-`` /
    ``.partial-`` links a crash left: pruning, publishing and the start-up sweep remove the links,
    never what they point to."""
    outside = tmp_path / "elsewhere"
    source = make_trainer()
    AsyncCheckpointer(outside, mode="sync", keep_last=10).attach(source)
    save_every(source, 1)
    source.run(token_batches(4), max_steps=3)
    torn = outside / "torn"
    torn.mkdir()
    (torn / "keep.txt").write_text("not the checkpointer's")
    before = tree_bytes(outside)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for step in (1, 2):  # complete: the run resumes from step 2, then keep_last=1 prunes both
        (directory / step_dir_name(step)).symlink_to(outside / step_dir_name(step))
    (directory / step_dir_name(0)).symlink_to(torn)  # torn and older than the newest: pruned
    (directory / f"{step_dir_name(9)}.pruned-0000abcd").symlink_to(outside / step_dir_name(3))
    (directory / f"{step_dir_name(9)}.partial-0000abcd").symlink_to(torn)
    (directory / step_dir_name(3)).symlink_to(outside / step_dir_name(3) / "nothing")  # dangling
    trainer = make_trainer(seed=1)
    checkpointer = AsyncCheckpointer(directory, mode="sync", keep_last=1).attach(trainer)
    save_every(trainer, 1)
    trainer.run(token_batches(8), max_steps=5)
    checkpointer.close()
    assert checkpointer.resumed_from == str(directory / step_dir_name(2))
    assert tree_bytes(outside) == before  # every marker and data file outside is where it was
    assert sorted(os.listdir(directory)) == ["latest", step_dir_name(5)]
    # a save of a step whose directory is a link replaces the link, not its target
    (directory / step_dir_name(5)).rename(directory / "real")
    (directory / step_dir_name(5)).symlink_to(outside / step_dir_name(3))
    again = make_trainer(seed=1)
    AsyncCheckpointer(directory, mode="sync", keep_last=1, resume=None).attach(again)
    save_every(again, 1)
    again.run(token_batches(10), max_steps=5)
    assert tree_bytes(outside) == before
    assert sorted(os.listdir(directory)) == ["latest", "real", step_dir_name(5)]
    assert not (directory / step_dir_name(5)).is_symlink()


def test_a_save_records_who_asked_for_it_and_the_checkpointer_counts_no_steps(tmp_path, caplog):
    trainer = make_trainer()
    AsyncCheckpointer(tmp_path, mode="sync", keep_last=5).attach(trainer)
    save_every(trainer, 2)
    ask = lambda: trainer.control.request_save("user: step 3")  # noqa: E731
    trainer.add_event_handler(Events.STEP_START(once=3), ask)
    with caplog.at_level(logging.INFO, logger="hookloop.handlers.checkpoint"):
        trainer.run(token_batches(20), max_steps=5)
    steps = [s for s, _ in complete_checkpoints(tmp_path)[0]]
    assert steps == [5, 4, 3, 2]  # asked for, and the last step: nothing counted by the checkpointer
    asked = {s: read_json(tmp_path / step_dir_name(s) / "rank_00000.json")["requested_by"] for s in steps}
    assert asked == {2: ["every 2 steps"], 3: ["user: step 3"], 4: ["every 2 steps"], 5: ["last step"]}
    assert "saving step 3 (asked by: user: step 3)" in caplog.text


def test_torn_newest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    trainer = make_trainer()
    AsyncCheckpointer(tmp_path, mode="sync").attach(trainer)
    save_every(trainer, 2)
    trainer.run(token_batches(8), max_steps=4)
    # A crash mid-save of step 6: files present, data truncated, no completion marker.
    torn = tmp_path / step_dir_name(6)
    shutil.copytree(tmp_path / step_dir_name(4), torn)
    os.remove(torn / MARKER)
    for f in torn.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:10])
    resumed = make_trainer(seed=1)
    checkpointer = AsyncCheckpointer(tmp_path, mode="sync").attach(resumed)
    with caplog.at_level(logging.WARNING, logger="hookloop.handlers.checkpoint"):
        resumed.run(token_batches(8), max_steps=5)
    assert checkpointer.resumed_from == str(tmp_path / step_dir_name(4))
    assert any(str(torn) in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointError, match="incomplete"):
        AsyncCheckpointer(tmp_path / "other", resume=torn)


@pytest.mark.parametrize("keep", [True, False])
def test_rollback_restores_the_newest_checkpoint_bitwise_and_keeps_or_rewinds_data(tmp_path, keep):
    """What the NaN detector does at a bad step 5: veto, choose the data position, fire ROLLBACK."""
    items = token_batches(20)
    trainer = make_trainer()
    checkpointer = AsyncCheckpointer(tmp_path, mode="async").attach(trainer)
    save_every(trainer, 3)
    at_save, after_rollback, batches = {}, {}, []

    @trainer.on(Events.STEP_END, priority=Priority.DECIDE - 900)
    def _remember(engine):
        if engine.state.step == 3 and not at_save:
            at_save.update(snapshot(engine))

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP)
    def _bad_step(engine):
        if engine.state.step == 5 and not after_rollback:
            engine.control.request_skip()
            engine.control.request_rollback(keep_data_position=keep)
            engine.fire(Events.ROLLBACK)
            after_rollback.update(snapshot(engine))
            after_rollback["step"] = torch.tensor(engine.state.step)

    trainer.add_event_handler(Events.STEP_START, lambda e: batches.append(e.state.batch))
    trainer.run(items, max_steps=6)
    assert int(after_rollback.pop("step")) == 3 and trainer.state.rollbacks == 1
    assert_bitwise(after_rollback, at_save)
    assert len(batches) == 8 and trainer.state.step == 6
    after = items[10:12] if keep else items[6:8]  # past the bad window, or step 4's again
    assert [torch.equal(mb[0], item[0]) for mb, item in zip(batches[5], after)] == [True, True]
    assert checkpointer.restore_latest(keep_data_position=True) == 6  # the direct API


def plain_trainer(seed: int, **model_overrides) -> Trainer:
    model = tiny_gpt(seed, **model_overrides)
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cross_entropy_loss)


def params_at_train_start(trainer: Trainer, out: dict, optimizer: bool = True) -> None:
    @trainer.on(Events.TRAIN_START)
    def _grab(engine):  # runs after the checkpointer's resume
        if optimizer:  # (get_state_dict gives an optimizer without state a zero-lr step)
            out.update(full_snapshot(engine))
        else:
            out.update({f"p.{n}": p.detach().clone() for n, p in engine.model.named_parameters()})


def test_finetune_from_loads_weights_only_and_starts_at_step_zero(tmp_path):
    source = make_trainer()
    AsyncCheckpointer(tmp_path / "pre", mode="sync").attach(source)
    source.run(token_batches(4), max_steps=2)
    weights = {f"p.{n}": p.detach().clone() for n, p in source.model.named_parameters()}
    tuned = make_trainer(seed=4)
    AsyncCheckpointer(tmp_path / "ft", mode="sync", finetune_from=tmp_path / "pre" / step_dir_name(2)).attach(
        tuned
    )
    at_start: dict = {}
    params_at_train_start(tuned, at_start, optimizer=False)
    tuned.run(token_batches(4), max_steps=1)
    assert tuned.state.step == 1 and tuned.state.tokens_seen == 64
    assert_bitwise(at_start, weights)


# ------------------------------------------------------------------------------ errors
def test_clear_errors_for_bad_directories_paths_and_models(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="checkpoint.directory"):
        AsyncCheckpointer(blocker / "ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        AsyncCheckpointer(tmp_path / "c", resume=tmp_path / "nowhere" / "step_00000010")
    with pytest.raises(ConfigError, match="checkpoint.mode"):
        AsyncCheckpointer(tmp_path / "c", mode="fast")

    trainer = make_trainer()
    AsyncCheckpointer(tmp_path / "c", mode="sync").attach(trainer)
    trainer.run(token_batches(4), max_steps=2)
    before = tree_bytes(tmp_path / "c")
    for overrides, pattern in (
        ({"n_layers": 3}, r"another model layout: blocks: 2 in the checkpoint, 3 in this model; "),
        (
            {"n_layers": 1, "d_model": 48},
            r"blocks: 2 in the checkpoint, 1 in this model; shapes \(checkpoint vs this model\): "
            r"blocks\.0\.ln1\.bias \(32,\) vs \(48,\)",
        ),
    ):
        other = plain_trainer(0, **overrides)
        AsyncCheckpointer(tmp_path / "c", mode="sync").attach(other)
        with pytest.raises(CheckpointLayoutError, match=pattern) as raised:
            other.run(token_batches(4), max_steps=3)
        # a setting to fix (ConfigError, exit code 2), naming the field and the fresh start
        assert isinstance(raised.value, ConfigError) and raised.value.field == "checkpoint.resume"
        assert "train.run_dir=<new dir>" in str(raised.value)
        assert other.state.step == 0
    assert tree_bytes(tmp_path / "c") == before  # nothing saved was touched


def test_a_gpt_checkpoint_of_the_earlier_qkv_layout_is_refused_not_misread(tmp_path):
    """The bundled GPT's fused projection was ``qkv`` ([all queries | all keys | all values]); it
    is ``qkv_heads`` now (head-major, for tensor parallelism): same shape, other meaning. A
    checkpoint of the earlier layout must not load into the new one (its heads would be read
    wrongly): the layout check refuses it, naming the parameter, and nothing is loaded."""
    from hookloop.models.gpt import Block

    class EarlierBlock(Block):
        @property
        def qkv_heads(self) -> torch.nn.Module:  # the forward's projection, under its earlier name
            return self.qkv

    old = tiny_gpt(0)
    for block in old.blocks.values():
        projection = block.qkv_heads
        del block.qkv_heads
        block.add_module("qkv", projection)
        block.__class__ = EarlierBlock
    assert "blocks.0.qkv.weight" in old.state_dict()
    trainer = Trainer(old, torch.optim.AdamW(old.parameters(), lr=1e-3), cross_entropy_loss)
    AsyncCheckpointer(tmp_path / "c", mode="sync").attach(trainer)
    trainer.run(token_batches(4), max_steps=2)
    new = plain_trainer(0)
    AsyncCheckpointer(tmp_path / "c", mode="sync").attach(new)
    with pytest.raises(CheckpointLayoutError, match=r"another model layout.*qkv"):
        new.run(token_batches(4), max_steps=3)
    assert new.state.step == 0


def tree_bytes(root) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes: what "nothing was changed" compares."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_layout_difference_names_pipeline_split_counts_and_shapes():
    model = {"tok_emb.weight": (64, 32), "blocks.0.w": (32,), "blocks.1.w": (32,), "head.weight": (64, 32)}
    assert describe_layout_difference(model, dict(model)) is None
    staged = {f"0.{k}": v for k, v in model.items()}
    assert "written by a pipeline-parallel run" in describe_layout_difference(staged, model)
    assert "written without pipeline stages" in describe_layout_difference(model, staged)
    wider = {**model, "blocks.2.w": (32,), "tok_emb.weight": (64, 48)}
    text = describe_layout_difference(model, wider)
    assert "blocks: 2 in the checkpoint, 3 in this model" in text
    assert "tok_emb.weight (64, 32) vs (64, 48)" in text
    renamed = {"emb.weight": (64, 32)}
    assert "1 parameters not in the checkpoint (emb.weight)" in describe_layout_difference(
        {"tok_emb.weight": (64, 32)}, renamed
    )


# ------------------------------------------------------------------------------ keep_best
def scripted_metric(trainer: Trainer, values: dict[int, float]) -> None:
    """Publish ``val_loss`` at STEP_END before the checkpointer saves, as validation does."""

    @trainer.on(Events.STEP_END, priority=Priority.VALIDATION)
    def _publish(engine):
        if engine.state.step in values:
            engine.state.metrics["val_loss"] = values[engine.state.step]


@pytest.mark.parametrize("metric_mode", ["min", "max"])
def test_keep_best_keeps_the_best_by_stored_metric_also_after_a_restart(tmp_path, metric_mode):
    sign = 1.0 if metric_mode == "min" else -1.0  # "max" sees the same ranking, negated
    first = {1: 5.0, 2: 3.0, 3: 4.0, 4: 1.0, 5: 6.0, 6: 2.5}
    options = dict(mode="sync", keep_last=1, keep_best=2, metric_mode=metric_mode)
    trainer = make_trainer()
    AsyncCheckpointer(tmp_path, **options).attach(trainer)
    save_every(trainer, 1)
    scripted_metric(trainer, {s: sign * v for s, v in first.items()})
    trainer.run(token_batches(20), max_steps=6)
    assert [s for s, _ in complete_checkpoints(tmp_path)[0]] == [6, 4]  # last 1; best 2: 4 and 6
    marker = read_json(tmp_path / step_dir_name(4) / MARKER)
    assert marker["metrics"] == {"val_loss": sign * 1.0}

    # A new process resumes at step 6: the ranking reads the values stored in the markers.
    again = make_trainer(seed=1)
    AsyncCheckpointer(tmp_path, **options).attach(again)
    save_every(again, 1)
    scripted_metric(again, {7: sign * 0.5, 8: sign * 9.0, 9: sign * 8.0})
    again.run(token_batches(20), max_steps=9)
    assert again.state.step == 9
    assert [s for s, _ in complete_checkpoints(tmp_path)[0]] == [9, 7, 4]  # last 1; best: 7, 4


def test_keep_best_ties_keep_the_older_and_unranked_saves_fall_to_keep_last(tmp_path, caplog):
    trainer = make_trainer()
    AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=1).attach(trainer)
    save_every(trainer, 1)
    # steps 1-2 have no val_loss yet (warned once); 3 validates; 4 and 5 carry 3's value over
    scripted_metric(trainer, {3: 2.0})
    with caplog.at_level(logging.WARNING, logger="hookloop.handlers.checkpoint"):
        trainer.run(token_batches(20), max_steps=5)
    assert [s for s, _ in complete_checkpoints(tmp_path)[0]] == [5, 3]
    warned = [r for r in caplog.records if "checkpoint.metric 'val_loss'" in r.getMessage()]
    assert len(warned) == 1


def test_keep_best_never_prunes_the_newest_known_good_checkpoint(tmp_path):
    trainer = make_trainer()
    AsyncCheckpointer(tmp_path, mode="sync", keep_last=1, keep_best=1).attach(trainer)
    save_every(trainer, 1)
    scripted_metric(trainer, {1: 1.0, 2: 5.0, 3: 6.0, 4: 7.0})

    @trainer.on(Events.STEP_END, priority=Priority.VALIDATION)
    def _distrust(engine):  # as a NaN detector does during a bad streak: step 2 is the last good one
        engine.save_policy.protect(min(engine.state.step, 2), by="test")

    trainer.run(token_batches(20), max_steps=4)
    assert [s for s, _ in complete_checkpoints(tmp_path)[0]] == [4, 2, 1]


def test_keep_best_settings_are_validated_naming_the_field(tmp_path):
    for kwargs, field in (
        ({"keep_best": -1}, "checkpoint.keep_best"),
        ({"keep_best": 2, "metric": ""}, "checkpoint.metric"),
        ({"keep_best": 2, "metric_mode": "median"}, "checkpoint.metric_mode"),
    ):
        with pytest.raises(ConfigError, match=field):
            AsyncCheckpointer(tmp_path, **kwargs)
    config = REPO / "examples" / "configs" / "gpt_tiny.yaml"
    with pytest.raises(ConfigError, match=r"checkpoint.metric: 'val_bleu' is not a metric this run produces"):
        load_run_config(config, ["checkpoint.keep_best=2", "checkpoint.metric=val_bleu"])
    with pytest.raises(ConfigError, match=r"checkpoint.metric: 'val_loss' .*data.val_fraction > 0"):
        load_run_config(config, ["checkpoint.keep_best=2", "data.val_fraction=0"])
    cfg = load_run_config(config, ["checkpoint.keep_best=2", "checkpoint.metric=loss/docs"])
    assert cfg.checkpoint.keep_best == 2


def test_a_failing_save_raises_and_leaves_the_previous_checkpoint_and_latest(tmp_path):
    trainer = make_trainer()
    AsyncCheckpointer(tmp_path, mode="async").attach(trainer)
    save_every(trainer, 2)

    session = []

    @trainer.on(Events.STEP_END(once=2), priority=Priority.ACT - 1)  # the save of step 2 just started
    def _session_id(engine):
        (partial,) = tmp_path.glob(f"{step_dir_name(2)}.partial-*")
        session.append(partial.name.rsplit("-", 1)[1])  # this run's partial directories end so

    @trainer.on(Events.STEP_START)
    def _block_step_4(engine):
        if engine.state.step == 4:  # the save of step 4 cannot create its directory
            (tmp_path / f"{step_dir_name(4)}.partial-{session[0]}").write_text("in the way")

    with pytest.raises(CheckpointError, match="step 4"):
        trainer.run(token_batches(12), max_steps=6)
    assert read_latest(tmp_path) == step_dir_name(2)
    assert [s for s, _ in complete_checkpoints(tmp_path)[0]] == [2]


def test_metadata_that_needs_arbitrary_unpickling_is_refused(tmp_path):
    """A planted ``.metadata`` fails the manifest check before it is unpickled; with the manifest
    rewritten to match, the allowlist refuses it (in verification too, so the checkpoint counts as
    damaged). More payloads: tests/test_checkpoint_unpickling.py."""
    import json
    import zlib

    trainer = make_trainer()
    AsyncCheckpointer(tmp_path, mode="sync").attach(trainer)
    trainer.run(token_batches(2), max_steps=1)
    path = tmp_path / step_dir_name(1)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(tmp_path / "owned"),))

    payload = pickle.dumps(Evil())
    (path / ".metadata").write_bytes(payload)
    with pytest.raises(CheckpointError, match="does not match its manifest"):
        SafeReader(path).read_metadata()
    resumed = make_trainer()
    AsyncCheckpointer(tmp_path, mode="sync").attach(resumed)
    with pytest.raises(CheckpointError, match="damaged"):
        resumed.run(token_batches(2), max_steps=2)
    marker = json.loads((path / MARKER).read_text())
    marker["manifest"]["files"][".metadata"].update(size=len(payload), checksum=f"{zlib.crc32(payload):08x}")
    (path / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        SafeReader(path).read_metadata()
    resumed = make_trainer()  # verification refuses it too: damage, and nothing older to fall back to
    AsyncCheckpointer(tmp_path, mode="sync").attach(resumed)
    with pytest.raises(CheckpointError, match="every complete checkpoint to load from is damaged"):
        resumed.run(token_batches(2), max_steps=2)
    assert not (tmp_path / "owned").exists()


# ------------------------------------------------------------------------------ kill test
def test_sigkill_at_random_moments_then_resume_equals_the_uninterrupted_run(tmp_path):
    """Kills alternate between a random moment (a seeded step target plus a random delay) and the
    instant a background write has started; each relaunch resumes from the newest complete
    checkpoint, never a torn one, and the final state equals the uninterrupted run's."""
    steps = 30
    reference, ref_checkpointer = ckpt_train.build(str(tmp_path / "reference"))
    reference.run(ckpt_train.loader(), max_steps=steps)
    ref_checkpointer.close()
    expected = ckpt_train.final_state(reference)

    rng = random.Random(1234)
    directory, out = tmp_path / "ckpt", tmp_path / "final.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "tests/scripts/ckpt_train.py"), str(directory), str(steps), str(out)]
    resumed_from, torn_after_kill, progress = [], 0, 0
    for attempt in range(5):
        during_save = attempt % 2 == 1
        target = min(progress + rng.randint(3, 6), steps - 3)
        delay = 0.0 if during_save else rng.uniform(0.0, 0.03)
        complete_before = {p for _, p in complete_checkpoints(directory)[0]}
        proc = start_forked(cmd, cwd=REPO, env=env, stream=True)
        try:
            for line in proc.stdout:
                word, _, rest = line.partition(" ")
                if word == "RESUMED":
                    resumed_from.append(rest.strip())
                    assert rest.strip() == max(complete_before)  # the newest complete one, never a torn one
                elif word == "STEP":
                    progress = int(rest)
                if (word == "SAVING" if during_save else word == "STEP") and progress >= target:
                    break
            time.sleep(delay)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL
        torn_after_kill += any(".partial-" in name for name in os.listdir(directory))
    result = run_process(cmd, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "RESUMED" in result.stdout and len(resumed_from) == 4
    assert torn_after_kill >= 1  # some kill did land in the middle of a save
    assert_bitwise(torch.load(out, weights_only=True), expected)
    # The last checkpoint's per-rank state (counters, data position, RNG, LR scheduler, handlers)
    # equals the uninterrupted run's, field by field.
    final = step_dir_name(steps)
    ours = read_json(directory / final / "rank_00000.json")
    theirs = read_json(tmp_path / "reference" / final / "rank_00000.json")
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if ours[k] != theirs[k]] == []


# ------------------------------------------------------------------------------ distributed


def _dist_resume_worker(rank: int, world: int, dp_mode: str, directory: str, load_from: str | None) -> dict:
    """Uninterrupted vs stopped-and-resumed (DDP or FSDP2); optionally load a 1-process checkpoint."""
    from hookloop.engine.parallel import init_distributed, wrap_data_parallel

    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    data = token_batches(8, seed=10 + rank)

    def build(seed: int = 0) -> Trainer:
        model = wrap_data_parallel(tiny_gpt(seed), dp_mode, mesh=info.mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return Trainer(model, optimizer, cross_entropy_loss, grad_accum_steps=2)

    result: dict = {}
    if load_from is not None:  # resharding 1 -> 2
        t = build(seed=9)
        ck = AsyncCheckpointer(os.path.join(directory, "from1"), resume=load_from, mode="sync").attach(t)
        loaded: dict = {}
        params_at_train_start(t, loaded)
        t.run(data, max_steps=3)
        ck.close()
        result["loaded_from_1"] = to_numpy(loaded)
    torch.manual_seed(0)
    ref = build()
    ref.run(data, max_steps=6)
    expected = full_snapshot(ref)

    torch.manual_seed(0)
    first = build()
    ck = AsyncCheckpointer(directory, mode="async").attach(first)
    save_every(first, 2)
    stop_at(first, 3)
    first.run(data, max_steps=6)
    ck.close()
    result["checkpoint_3"] = to_numpy(full_snapshot(first))

    second = build(seed=4)
    ck2 = AsyncCheckpointer(directory, mode="async_copy").attach(second)
    save_every(second, 2)
    second.run(data, max_steps=6)
    ck2.close()
    got = full_snapshot(second)
    result["bitwise"] = got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    result["steps"] = (second.state.step, ck2.resumed_from)
    return result


@pytest.mark.parametrize("dp_mode", ["ddp", "fsdp"])
def test_two_process_resume_is_bitwise_and_fsdp_checkpoints_reshard(tmp_path, dp_mode):
    load_from = None
    if dp_mode == "fsdp":  # 1 -> 2: a single-process checkpoint that the FSDP2 ranks load
        single = plain_trainer(2)
        AsyncCheckpointer(tmp_path / "single", mode="sync").attach(single)
        single.run(token_batches(4), max_steps=2)
        load_from = str(tmp_path / "single" / step_dir_name(2))
        single_state = full_snapshot(single)
    directory = str(tmp_path / "dist")
    results = run_distributed(_dist_resume_worker, 2, dp_mode, directory, load_from)
    for r in results:
        assert r["bitwise"], f"{dp_mode}: resumed run differs from the uninterrupted one"
        assert r["steps"] == (6, str(tmp_path / "dist" / step_dir_name(3)))
    if dp_mode == "fsdp":
        assert_bitwise(from_numpy(results[0]["loaded_from_1"]), single_state)
        # 2 -> 1: the FSDP2 checkpoint of step 3 loads into one plain process
        one = plain_trainer(7)
        ck = AsyncCheckpointer(tmp_path / "one", resume=tmp_path / "dist" / step_dir_name(3)).attach(one)
        loaded: dict = {}
        params_at_train_start(one, loaded)
        one.run(token_batches(8), max_steps=4)
        assert ck.resumed_from.endswith(step_dir_name(3)) and one.state.step == 4
        assert_bitwise(loaded, from_numpy(results[0]["checkpoint_3"]))


def test_sigterm_through_the_step_scheduler_saves_stops_and_resumes_bitwise(tmp_path):
    from hookloop.handlers.step_scheduler import StepScheduler

    def build(seed: int, data: list, directory=None, signal_at=None):
        trainer = make_trainer(seed)
        scheduler = StepScheduler(
            global_batch_size=4,
            local_batch_size=2,
            dp_size=1,
            dataloader=data,
            max_steps=9,
            ckpt_every_steps=100,
        )
        scheduler.attach(trainer)
        if directory is not None:
            AsyncCheckpointer(directory, mode="async").attach(trainer)
        if signal_at is not None:
            trainer.add_event_handler(
                Events.MICROBATCH,
                lambda e: (
                    os.kill(os.getpid(), signal.SIGTERM)
                    if e.state.step == signal_at and e.state.microbatch == 0
                    else None
                ),
            )
        return trainer, scheduler

    data = token_batches(8)  # 2 microbatches per step: 4 steps per epoch
    seed_all()
    ref, _ = build(0, data)
    ref.run(data)
    seed_all()
    first, scheduler = build(0, data, tmp_path, signal_at=6)
    state = first.run(data)
    scheduler.close()
    assert (state.step, state.control.exit_code) == (6, ExitCode.STOPPED)
    assert read_latest(tmp_path) == step_dir_name(6)
    seed_all(5)
    second, scheduler = build(3, data, tmp_path)
    state = second.run(data)
    scheduler.close()
    assert (state.step, state.epoch, state.control.exit_code) == (9, ref.state.epoch, 0)
    assert_bitwise(snapshot(second), snapshot(ref))


def test_a_second_checkpointer_on_a_directory_in_use_is_refused_and_leaves_the_live_save(tmp_path):
    """One run writes a checkpoint directory at a time: a second run on it is refused at TRAIN_START
    (it holds no lock of its own yet) without creating, removing or sweeping anything, while the
    first run's save is in flight; the first run publishes it and releases the directory at the end."""
    from hookloop.engine.run_lock import LOCK_FILE, RunDirInUse

    directory = tmp_path / "ckpt"
    first = make_trainer()
    live = AsyncCheckpointer(directory, mode="async").attach(first)
    save_every(first, 1)
    seen = {}

    @first.on(Events.STEP_END(once=2), priority=Priority.ACT - 1)  # the save of step 2 just started
    def second_start() -> None:
        (partial,) = directory.glob(f"{step_dir_name(2)}.partial-*")
        names = sorted(os.listdir(directory))
        second = make_trainer(seed=1)
        AsyncCheckpointer(directory, mode="sync").attach(second)
        save_every(second, 1)
        with pytest.raises(RunDirInUse, match=r"checkpoint\.directory: .*ckpt is in use by this process"):
            second.run(token_batches(4), max_steps=2)
        seen.update(partial_kept=os.path.isdir(partial), names=(names, sorted(os.listdir(directory))))
        seen["started"] = second.started

    first.run(token_batches(6), max_steps=4)
    live.close()
    assert seen["partial_kept"] and seen["started"] is False
    assert seen["names"][0] == seen["names"][1]  # the refused start added and removed nothing
    assert LOCK_FILE in seen["names"][0]  # held by the first run while it ran ...
    assert not (directory / LOCK_FILE).exists()  # ... and released at its end
    assert read_latest(directory) == step_dir_name(4)
