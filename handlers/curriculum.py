"""PhaseCurriculum: training phases that change the data mixture and scale the learning rate.

A :class:`Phase` starting at step ``k`` applies to step ``k`` itself: its weights choose the data of
step ``k``, its ``lr_scale`` the update of step ``k``. Datasets a phase does not name keep their
original weight (the sampler's weights when the curriculum is built); steps before the first phase
use the original weights and temperature, phases use ``mix_temperature``.

Data: step-aligned, not call-aligned
    Every optimizer step takes ``samples_per_step = batch_size * grad_accum_steps`` samples per rank,
    i.e. ``D = samples_per_step * world_size`` draws of the sampler's global stream. At TRAIN_START the
    curriculum anchors the stream (after step ``s0`` the position is draw ``d0``) and hands the
    sampler the whole phase schedule in draw indices: phase ``k``'s weights from draw
    ``d0 + (k - 1 - s0) * D`` on (:meth:`MixtureSampler.set_schedule`). The weights of a draw are
    thus fixed by the step it belongs to before anything is drawn, so a ``DataLoader`` whose workers
    prefetch batches ahead still delivers every batch of step ``k - 1`` from the old phase and every
    batch of step ``k`` from the new one. Nothing changes weights during the run.

Resume
    The curriculum is registered as a stateful handler (``state_key``). Its state is the sampler state
    at the position right after the last completed step (``d0 + (step - s0) * D``, computed, not the
    sampler's read-ahead position) plus that step, so loading it with the trainer counters continues
    with exactly the batches the uninterrupted run would have had, in O(1). The active phase follows
    from the step. Use :class:`engine.data.MixtureLoader` as the training loader so that a
    checkpointer saving the loader position gets the same exact position with workers. The position
    is a global draw count, so a run may resume on another number of data-parallel ranks (logged):
    with the same global batch ``D`` every step draws what it would have drawn; a different ``D`` is
    a ``ConfigError`` at TRAIN_START.

Learning rate
    Optimizer step ``s`` updates with ``scheduler_lr * lr_scale(s)``, ``scheduler_lr`` being the LR
    scheduler's ``get_last_lr()`` after step ``s - 1`` (without a scheduler, the optimizer's rates
    when training started); the scaled rate is in ``optimizer.param_groups`` (and ``state.lr``) from
    the end of step ``s - 1`` (or TRAIN_START) until step ``s``'s update. ``lr_scale`` is the
    multiplier of the trainer's schedule (:class:`engine.lr.ScheduledRates`, which writes the
    rates): it never compounds, even under chainable schedulers, and a vetoed step (which does not
    step the scheduler) leaves the next step its own scale.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.checks import check_int, check_number
from hookloop.engine.data.config import DataConfig, Phase, check_phases
from hookloop.engine.data.loader import MixtureLoader
from hookloop.engine.data.sampler import MixtureSampler
from hookloop.engine.errors import ConfigError
from hookloop.engine.events import Events, Priority
from hookloop.engine.handler import Handler

__all__ = ["Phase", "PhaseCurriculum", "check_phases"]

# Where the curriculum runs, relative to the phases of an event (engine.Priority).
#: TRAIN_START: the phase of the restored step, right after the restore.
ALIGN_PHASE = Priority.OBSERVE
#: STEP_START: this step's lr_scale and phase; STEP_END: the next phase's weights. After the step's
#: metrics are published and validation ran, before the per-dataset sums.
PHASE = Priority.OBSERVE - 100
#: ROLLBACK: re-align to the restored step, late in DEFAULT: after the restore and after user handlers
#: near DEFAULT's order 0.
ALIGN_AFTER_RESTORE = Priority.DEFAULT - 900

logger = logging.getLogger(__name__)

_STATE_FORMAT = "hookloop-phase-curriculum"
_STATE_VERSION = 1


class PhaseCurriculum(Handler):
    """Phases of training: per-phase dataset weights and LR scale, exact at step boundaries.

    Args:
        sampler: the training loader's :class:`MixtureSampler` (its weights now are the originals).
        phases: :class:`Phase` list (or config objects / mappings with the same fields), validated:
            strictly increasing ``start_step``, known dataset names, weights ``>= 0`` and not all zero,
            ``lr_scale > 0``.
        mix_temperature: temperature of the phases' weights (``p_i ∝ w_i**(1/T)``).
        samples_per_step: samples per optimizer step on one rank; by default ``batch_size *
            trainer.plan.grad_accum_steps`` from the ``DataLoader`` passed to ``trainer.run``, which must
            draw from ``sampler``.
        state_key: key of the curriculum (and the data position) in checkpoints.

    Publishes ``state.metrics["phase"]`` (index of the active phase, -1 before the first) and
    ``state.metrics["lr_scale"]`` at every step. See the module documentation for exact semantics.
    """

    state_key = "curriculum"
    # a rollback restores the counters and rewinds (or keeps) the data itself; the anchor follows
    restore_on_rollback = False
    # configured by the engine's ``data`` section (phases and their temperature)
    Config = DataConfig
    section = "data"
    doc = "docs/data.md"  # its page (a shipped handler: handlers/declarations.py)

    def __init__(
        self,
        sampler: MixtureSampler,
        phases: Sequence[Any],
        *,
        mix_temperature: float = 1.0,
        samples_per_step: int | None = None,
        state_key: str = "curriculum",
        _field: str = "phases",
    ) -> None:
        if not isinstance(sampler, MixtureSampler):
            raise TypeError(f"sampler: expected a MixtureSampler, got {type(sampler).__name__}")
        temperature_field = "data.mix_temperature" if _field.startswith("data.") else "mix_temperature"
        check_number(temperature_field, mix_temperature, positive=True)
        check_int("samples_per_step", samples_per_step, allow_none=True)
        names = list(sampler.mixture.names)
        self.sampler = sampler
        self.phases = check_phases(phases, names, _field, base_weights=sampler.weights)
        self.mix_temperature = float(mix_temperature)
        self.samples_per_step = samples_per_step
        self.state_key = state_key
        self.original_weights = sampler.weights
        self.original_temperature = sampler.temperature
        self._phase_weights = [{**self.original_weights, **phase.dataset_weights} for phase in self.phases]
        self._scales_lr = any(phase.lr_scale != 1.0 for phase in self.phases)
        self._anchor: tuple[int, int] | None = None  # after step s0 the stream is at global draw d0
        self._completed: int | None = None  # the last step that completed (STEP_END)
        self._draws_per_step: int | None = None
        self._last_phase: int | None = None
        self._loaded: tuple[int, int] | None = None  # (draws per step, data-parallel ranks) of a loaded state

    @classmethod
    def from_config(
        cls,
        cfg: DataConfig,
        *,
        sampler: MixtureSampler | None = None,
        samples_per_step: int | None = None,
        state_key: str = "curriculum",
    ) -> PhaseCurriculum | None:
        """From the ``data`` section (``phases``, ``mix_temperature``); errors name
        ``data.phases[i]...``. With no phases it still keeps the data position step-exact.

        ``sampler`` is the training loader's :class:`MixtureSampler`. Without one (the data is not
        a mixture) there is nothing to schedule and the result is None; phases then are an error."""
        if sampler is None:
            if cfg.phases:
                raise ConfigError(
                    "data.phases",
                    "need the training loader's MixtureSampler: pass sampler=... (or remove the phases)",
                )
            return None
        return cls(
            sampler,
            cfg.phases,
            mix_temperature=cfg.mix_temperature,
            samples_per_step=samples_per_step,
            state_key=state_key,
            _field="data.phases",
        )

    # ------------------------------------------------------------------ phase arithmetic
    def phase_index(self, step: int) -> int:
        """Index of the phase that applies to optimizer step ``step`` (1-based), -1 before the first."""
        index = -1
        for i, phase in enumerate(self.phases):
            if max(phase.start_step, 1) <= step:
                index = i
        return index

    def weights_at(self, step: int) -> dict[str, float]:
        """Dataset weights that choose the data of step ``step``."""
        i = self.phase_index(step)
        return dict(self.original_weights if i < 0 else self._phase_weights[i])

    def lr_scale_at(self, step: int) -> float:
        i = self.phase_index(step)
        return 1.0 if i < 0 else self.phases[i].lr_scale

    def _temperature_at(self, step: int) -> float:
        return self.original_temperature if self.phase_index(step) < 0 else self.mix_temperature

    def _draws_after(self, step: int) -> int:
        assert self._anchor is not None and self._draws_per_step is not None
        s0, d0 = self._anchor
        return d0 + (step - s0) * self._draws_per_step

    # ------------------------------------------------------------------ attaching
    def attach(self, trainer: Any) -> PhaseCurriculum:
        if self.trainer is not None:
            raise RuntimeError("this PhaseCurriculum is already attached to a trainer")
        if self._scales_lr and trainer.rates.multiplier is not None:
            raise RuntimeError("the learning rate is already scaled by another PhaseCurriculum")
        trainer.add_event_handler(Events.TRAIN_START, self._on_train_start, priority=ALIGN_PHASE)
        trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=PHASE)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=PHASE)
        trainer.add_event_handler(Events.ROLLBACK, self._on_rollback, priority=ALIGN_AFTER_RESTORE)
        if self._scales_lr:
            trainer.rates.multiplier = self.lr_scale_at
        return super().attach(trainer)

    def _infer_samples_per_step(self) -> int:
        trainer = self.trainer
        loader = trainer.step_data.data if trainer.step_data is not None else None
        batch_sampler = getattr(loader, "batch_sampler", None)
        sampler = getattr(batch_sampler, "sampler", None)
        batch_size = getattr(loader, "batch_size", None) or getattr(batch_sampler, "batch_size", None)
        if self.samples_per_step is not None:
            expected = batch_size * trainer.plan.grad_accum_steps if batch_size else None
            if sampler is self.sampler and expected and self.samples_per_step != expected:
                raise ConfigError(
                    "samples_per_step",
                    f"is {self.samples_per_step} but the loader takes batch_size {batch_size} x "
                    f"grad_accum_steps {trainer.plan.grad_accum_steps} = {expected} samples per step",
                )
            return self.samples_per_step
        if sampler is not self.sampler or not batch_size:
            raise ConfigError(
                "samples_per_step",
                "cannot be inferred: the data passed to trainer.run is not a DataLoader (with a batch_size) "
                "drawing from this curriculum's sampler; pass samples_per_step=batch_size*grad_accum_steps",
            )
        if getattr(loader, "num_workers", 0) and not isinstance(loader, MixtureLoader):
            logger.warning(
                "the training DataLoader prefetches with workers: use engine.data.MixtureLoader so that a "
                "checkpoint of the loader position is exact too (the curriculum's own state is exact)"
            )
        return batch_size * trainer.plan.grad_accum_steps

    # ------------------------------------------------------------------ events
    def _on_train_start(self) -> None:
        trainer, state, sampler = self.trainer, self.trainer.state, self.sampler
        draws_per_step = self._infer_samples_per_step() * sampler.world_size
        if self._loaded is not None:
            self._check_global_batch(draws_per_step)
        if self._anchor is not None and self._completed is not None:
            consumed = self._draws_after(self._completed)  # after the last step that trained
        else:
            loader = trainer.step_data.data if trainer.step_data is not None else None
            consumed = loader.position if isinstance(loader, MixtureLoader) else sampler.draws
        if sampler.draws != consumed:  # indices read ahead by an earlier iterator go back to the stream
            sampler.load_state_dict(sampler.state_dict_at(consumed))
        self._anchor = (state.step, consumed)
        self._completed = state.step
        self._draws_per_step = draws_per_step
        sampler.set_schedule(self._schedule())
        self._last_phase = None
        state.lr = self._apply_lr(state.step + 1)

    def _check_global_batch(self, draws_per_step: int) -> None:
        """A resumed run must take the checkpoint's global batch per step, whatever its number of
        data-parallel ranks: then step ``k`` draws the same global samples as in an unbroken run."""
        (saved, saved_ranks), self._loaded = self._loaded, None  # type: ignore[misc]
        sampler = self.sampler
        per_rank = draws_per_step // sampler.world_size
        if saved and saved != draws_per_step:
            raise ConfigError(
                "step_scheduler.global_batch_size",
                f"the checkpoint at step {self._completed} was trained with {saved} samples per optimizer "
                f"step over all data-parallel ranks, this run takes {draws_per_step} ({per_rank} per rank x "
                f"{sampler.world_size} ranks); resume with global_batch_size={saved} (local_batch_size x "
                "grad_accum_steps x data-parallel size) so that every step takes the samples it would have "
                "taken without the restart",
            )
        if saved_ranks and saved_ranks != sampler.world_size:
            logger.info(
                "elastic resume at step %s: data written by %d data-parallel ranks continues on %d; "
                "global batch %d samples per step kept (%d per rank per step)",
                self._completed,
                saved_ranks,
                sampler.world_size,
                draws_per_step,
                per_rank,
            )

    def _schedule(self) -> list[tuple[int, dict[str, float], float]]:
        s0, d0 = self._anchor  # type: ignore[misc]
        first = s0 + 1
        changes = [(d0, self.weights_at(first), self._temperature_at(first))]
        for i, phase in enumerate(self.phases):
            start = max(phase.start_step, 1)
            if start > first:
                changes.append((self._draws_after(start - 1), self._phase_weights[i], self.mix_temperature))
        return changes

    def _on_step_start(self) -> None:
        state = self.trainer.state
        index = self.phase_index(state.step)
        if index != self._last_phase:
            if self._last_phase is not None or index >= 0:
                logger.info(
                    "step %d: phase %d (weights %s, lr_scale %g)",
                    state.step,
                    index,
                    self.weights_at(state.step),
                    self.lr_scale_at(state.step),
                )
            self._last_phase = index
        self._apply_lr(state.step)
        state.metrics["phase"] = index
        state.metrics["lr_scale"] = self.lr_scale_at(state.step)

    def _on_step_end(self) -> None:
        state = self.trainer.state
        self._completed = state.step
        state.lr = self._apply_lr(state.step + 1)

    def _on_rollback(self) -> None:
        # The checkpointer moved the counters back to the checkpoint's step. If it also rewound the data
        # the anchor still maps steps to draws; if the data keeps going, the step the data is at moved.
        state, rollback = self.trainer.state, self.trainer.control.rollback
        if rollback is not None and rollback.keep_data_position and self._completed is not None:
            if self._anchor is not None and self._draws_per_step is not None:
                self._anchor = (state.step, self._draws_after(self._completed))
        self._completed = state.step
        self._apply_lr(state.step + 1)

    # ------------------------------------------------------------------ learning rate
    def _apply_lr(self, step: int) -> float:
        """The schedule writes the rates of step ``step`` (this curriculum scales them); the first group's."""
        trainer = self.trainer
        return trainer.rates.write(step) if self._scales_lr else trainer.optimizer.param_groups[0]["lr"]

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        """The data position right after step ``trainer.state.step`` and that step's phase (JSON-safe).
        Taken at STEP_END (as checkpointers do) it describes the position after the step just done."""
        step = self.trainer.state.step if self.trainer is not None else (self._completed or 0)
        if self._anchor is not None and self._draws_per_step is not None:
            draws = self._draws_after(step)
            sampler_state = self.sampler.state_dict_at(draws)
        else:
            sampler_state = self.sampler.state_dict()
            draws = sampler_state["draws"]
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "step": int(step),
            "phase": self.phase_index(step),
            "draws": int(draws),
            "draws_per_step": self._draws_per_step,
            "unscaled_lrs": self.trainer.rates.base if self.trainer is not None else None,
            "sampler": sampler_state,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue right after the step ``state_dict`` was taken at (load the trainer counters too)."""
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != _STATE_FORMAT:
            got = state_dict.get("format") if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise CheckpointError(
                f"PhaseCurriculum state['format'] must be {_STATE_FORMAT!r}, got {got!r}: load what "
                "PhaseCurriculum.state_dict() returned"
            )
        if state_dict.get("version") != _STATE_VERSION:
            raise CheckpointError(
                f"PhaseCurriculum state['version'] is {state_dict.get('version')!r}, expected "
                f"{_STATE_VERSION}: the state was written by another hookloop version"
            )
        try:
            step, draws = int(state_dict["step"]), int(state_dict["draws"])
            sampler_draws = int(state_dict["sampler"]["draws"])
        except KeyError as e:
            raise CheckpointError(f"PhaseCurriculum state is missing the key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"PhaseCurriculum state['step'], ['draws'] and ['sampler']['draws'] must be integers: {e}"
            ) from None
        if sampler_draws != draws:
            raise CheckpointError(
                f"PhaseCurriculum state['draws'] ({draws}) does not match state['sampler']['draws'] "
                f"({sampler_draws}): the state is corrupt"
            )
        self.sampler.load_state_dict(state_dict["sampler"])
        self._anchor = (step, draws)
        self._completed = step
        self._draws_per_step = int(state_dict.get("draws_per_step") or 0)
        self._loaded = (self._draws_per_step, int(state_dict["sampler"].get("world_size") or 0))
        if state_dict.get("unscaled_lrs") is not None and self.trainer is not None:
            self.trainer.rates.base = [float(lr) for lr in state_dict["unscaled_lrs"]]
        if state_dict.get("phase") != self.phase_index(step):
            logger.warning(
                "the checkpoint was in phase %s at step %d, the configured phases give phase %d: "
                "the configured phases apply from here on",
                state_dict.get("phase"),
                step,
                self.phase_index(step),
            )

    def __repr__(self) -> str:
        return f"PhaseCurriculum({len(self.phases)} phases, mix_temperature={self.mix_temperature:g})"
