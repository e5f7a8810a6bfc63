"""RerunAttribution: rerun a bad step to tell a bad sample from a bad rank.

When the :class:`~hookloop.handlers.NaNDetector` finds a step bad (a non-finite loss or gradient
norm, or a loss spike by its rule) on some rank, every rank knows it from the step's agreement,
before the optimizer. Then, on every rank together (nothing runs on a good step but keeping the
step's RNG state)::

    rerun this rank's microbatches: same inputs, weights, RNG state    -> same-rank verdicts, gathered
    if any rerun is bad and peer_rerun: send them to the next replica (point to point),
        rerun the peer's microbatches with its RNG state                -> peer verdicts, gathered
    classify each replica r that was bad:
        good on its own rerun                  -> transient fault on r (counted, named with its host)
        bad on its rerun and on its peer's     -> data or numerics: its bad samples are quarantined
        bad on its rerun, good on its peer's   -> faulty rank r (named with its host)

A replica is one rank, or under tensor parallelism the tensor-parallel group that computes its step
together: the group reruns together, and each of its ranks sends to the next replica's rank of the
same tensor-parallel coordinate. Under pipeline parallelism a replica is its pipeline (every stage,
and each stage's tensor-parallel ranks): every stage reruns the step's schedule together
(:meth:`engine.pipeline.PipelineRuntime.rerun_losses`) from its own RNG state, the losses come from
the last stage to every stage (as in the step), so every stage judges alike, and each stage sends
its microbatches to the same stage of the next replica's pipeline. With replica groups the
verdicts and quarantine of every group are recorded in every group (the agreement's transport,
``across_groups``), and a group of one replica sends its microbatches to the next group to rerun.

The decision is made from gathered values, the same on every rank. The step stays vetoed (the
detector's skip); the reruns leave no gradient and put the RNG and the model's buffers back as the
step left them, so the run goes on exactly as it would have without them. At most ``max_reruns`` bad
steps are rerun in a run.

A data verdict quarantines the samples: the bad rank reruns the bad microbatches sample by sample
(forward only; under pipeline parallelism through every stage of its pipeline) to find the samples
whose loss is non-finite (all of the bad microbatches' samples when none alone is, a spike), writes
them to ``run_dir/quarantine.jsonl`` (rank 0; one line per step and dataset: ``{"step", "dataset",
"ids", "reason"}``), and every rank's training loader stops fetching them
(:meth:`engine.data.MixtureLoader.quarantine`; under pipeline parallelism a batch left short is filled
back with copies of its other samples, ``full_batches``). The handler's checkpoint state holds the
quarantine, so a resumed run, on any number of data-parallel ranks, never trains on them again;
``data.quarantine=FILE`` starts a new run that skips a file's samples.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hookloop.engine import ConfigError, Events, ExitCode, Trainer, TrainingAborted, parallel
from hookloop.engine.batch import forward_and_loss
from hookloop.engine.data import MixtureLoader, SampleTrace
from hookloop.engine.events import Priority
from hookloop.engine.handler import Handler, checked_settings
from hookloop.engine.pipeline.runtime import PipelineRuntime
from hookloop.engine.record_file import cut_to_step
from hookloop.engine.step_body import LocalStepBody, StepBody
from hookloop.handlers.sections.attribution import AttributionConfig

__all__ = ["AttributionConfig", "RerunAttribution"]

logger = logging.getLogger(__name__)

#: STEP_START: keep the RNG state the step's forward starts from (before anything draws from it).
KEEP_RNG = Priority.CLOCK + 800
QUARANTINE_FILE = "quarantine.jsonl"


class _Rerun(NamedTuple):
    reason: str | None  # why the rerun is bad by the detector's rule; None: good
    bad_microbatches: list[int]  # the microbatches whose own loss is bad
    loss: float  # the rerun's mean microbatch loss


class RerunAttribution(Handler):
    """Rerun a bad step on its rank and on a peer; name the cause; quarantine bad samples."""

    state_key = "attribution"
    restore_on_rollback = False
    asks_after_agreement = False
    Config = AttributionConfig
    section = "attribution"
    doc = "docs/nan_detector.md"  # its page (a shipped handler: handlers/declarations.py)

    def __init__(
        self,
        *,
        max_reruns: int = 10,
        peer_rerun: bool = True,
        quarantine: bool = True,
        on_faulty_rank: str = "warn",
        run_dir: str | Path | None = None,
        dataloader: Any = None,
    ) -> None:
        checked_settings(AttributionConfig, locals(), "attribution")
        self.max_reruns, self.peer_rerun, self.quarantine = max_reruns, peer_rerun, quarantine
        self.on_faulty_rank = on_faulty_rank
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.loader = dataloader if isinstance(dataloader, MixtureLoader) else None
        self.reruns = 0
        self.transients: dict[str, int] = {}  # "rank <r> (<host>)" -> transient faults seen
        self.faulty: list[dict[str, Any]] = []  # {"step", "rank", "host", "reason"}
        self.quarantined: list[dict[str, Any]] = []  # the rows of quarantine.jsonl
        self.verdicts: list[dict[str, Any]] = []  # {"step", "rank", "host", "cause", "reason"}
        self._rng: Any = None  # the RNG state the step's forward started from
        self._local_loss: Any = None
        self.detector: Any = None  # the NaN detector: its verdict and its rule (judge)
        self.trace: SampleTrace | None = None
        self._replica_ranks: list[tuple[int, ...]] | None = None
        self._kind = "tensor-parallel group"  # what a replica of several ranks is (log lines)

    def attach(self, trainer: Trainer) -> RerunAttribution:
        self.detector = trainer.get_handler("nan_detector")
        if self.detector is None:
            raise ConfigError(
                "attribution",
                "judges steps by the NaN detector's rule: attach a NaNDetector first (nan.enabled)",
            )
        if not isinstance(trainer.step_body, LocalStepBody | PipelineRuntime):
            raise ConfigError(
                "attribution",
                "reruns a step of a model held whole on each rank, split by tensor parallelism or cut into "
                f"pipeline stages (plain, DDP, FSDP2, TP, PP); not a step body of another class "
                f"({type(trainer.step_body).__name__}), whose step it cannot run again: set "
                "attribution.enabled=false",
            )
        trainer.add_event_handler(Events.STEP_START, self._keep_rng, priority=KEEP_RNG)
        trainer.add_event_handler(Events.TRAIN_START, self._find_trace, priority=Priority.OBSERVE - 500)
        trainer.add_event_handler(Events.RUN_STARTED, self._cut_file, priority=Priority.OBSERVE)
        trainer.agreement.add("attribution.bad", self._fill, self._on_verdict)
        return super().attach(trainer)

    def _find_trace(self) -> None:
        """The sample trace names the step's samples (attached after the shipped handlers)."""
        self.trace = self.trainer.get_handler(SampleTrace)
        if self.quarantine and (self.trace is None or self.loader is None):
            raise ConfigError(
                "attribution.quarantine",
                "names the bad samples from the sample trace of a MixtureLoader: set data.trace_samples=true "
                "(or attribution.quarantine=false)",
            )

    def _cut_file(self) -> None:
        """``quarantine.jsonl`` back to the rows of the quarantine the run resumed with (steps up to
        the one it starts from, as the checkpoint holds them): a row a killed run wrote after its
        last checkpoint is written again when the resumed run finds that step bad again, once."""
        if self.run_dir is not None and parallel.rank() == 0:
            cut_to_step(self.run_dir / QUARANTINE_FILE, self.trainer.state.step)

    def _fill(self) -> Any:
        """This rank's verdict for the agreement; its own loss kept (not read) for a rerun's judge."""
        self._local_loss = self.trainer.state.peek("loss")
        return self.detector.verdict

    def _keep_rng(self) -> None:
        self._rng = _rng_state(self.trainer.device)  # a few KB copied: the only cost on a good step

    # ------------------------------------------------------------------ the reruns
    def _rerun(self, microbatches: Sequence[Any], rng: Any) -> _Rerun:
        """Forward and backward of ``microbatches`` from RNG state ``rng`` on this rank's weights,
        its gradients local (DDP: no sync; FSDP2: judged on the loss only), then dropped. Under
        pipeline parallelism every stage of the pipeline reruns the step's schedule together (the
        losses and the norm are the pipeline's, on each stage); stages replicated over ``dp`` sync
        their gradients in it as in the step, so the rerun is judged on its loss only."""
        trainer = self.trainer
        body: StepBody = trainer.step_body
        if rng is not None:
            _set_rng_state(rng)
        trainer.optimizer.zero_grad(set_to_none=True)
        if isinstance(body, PipelineRuntime):
            losses = body.rerun_losses(microbatches, trainer.step_context)
            norm = body.grad_norm() if body.dp_size == 1 else None
            norm = float(norm) if isinstance(norm, torch.Tensor) else norm
            trainer.optimizer.zero_grad(set_to_none=True)
            return self._judged(losses, norm)
        ctx, model = trainer.step_context, trainer.model
        fsdp = hasattr(model, "set_requires_gradient_sync")
        n, losses = len(microbatches), []
        with model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext():
            for i, microbatch in enumerate(microbatches):
                inputs, targets = ctx.prepare(microbatch)
                if fsdp:  # every rank reruns together: the collectives of a normal step
                    model.set_requires_gradient_sync(i == n - 1)
                with ctx.loss_context():
                    with ctx.autocast():
                        _, loss = body.compute_loss(inputs, targets, ctx)
                    (loss / n).backward()
                losses.append(float(loss.detach()))
        norm = body.grad_norm()
        norm = float(norm) if isinstance(norm, torch.Tensor) else norm
        trainer.optimizer.zero_grad(set_to_none=True)
        return self._judged(losses, None if fsdp else norm)

    def _judged(self, losses: list[float], norm: float | None) -> _Rerun:
        """A rerun's microbatch losses and gradient norm (None: not judged on it), by the detector's rule."""
        judge = self.detector.judge
        bad = [i for i, loss in enumerate(losses) if judge(loss) is not None]
        loss = sum(losses) / max(len(losses), 1)
        return _Rerun(judge(loss, norm), bad, loss)

    def _bad_samples(
        self, microbatches: Sequence[Any], bad_microbatches: list[int], suspect: bool
    ) -> list[str]:
        """This rank's ids to quarantine (none unless ``suspect``): the samples of the ``bad``
        microbatches whose own forward gives a non-finite loss; all of those microbatches' samples
        when none does alone, or when a step body's own loss cannot be run on one sample. Under
        FSDP2 every rank runs as many forwards as the rank with the most suspects (the collectives
        of a forward), the others on a sample of their own whose loss is not looked at."""
        ids = self.trace.step_ids() if self.trace is not None else []
        picked = bad_microbatches or list(range(len(microbatches)))
        suspects = (
            [(i, j, sid) for i in picked if i < len(ids) for j, sid in enumerate(ids[i])] if suspect else []
        )
        trainer, model = self.trainer, self.trainer.model
        if type(trainer.step_body).compute_loss is not StepBody.compute_loss or not ids:
            return [sid for _, _, sid in suspects]
        if isinstance(trainer.step_body, PipelineRuntime):
            return self._bad_samples_through_stages(microbatches, ids, suspects)
        fsdp = hasattr(model, "set_requires_gradient_sync")
        rounds = max(parallel.gather_objects(len(suspects))) if fsdp else len(suspects)
        module = model if fsdp else getattr(model, "module", model)  # DDP's: no collective alone
        found = []
        module.eval()  # one sample: no batch statistics
        with torch.no_grad():
            for k in range(rounds):
                i, j, sid = suspects[k] if k < len(suspects) else (0, 0, None)
                inputs, targets = trainer.step_context.prepare(_slice(microbatches[i], j, len(ids[i])))
                with trainer.autocast():
                    _, loss = forward_and_loss(module, inputs, targets, trainer.loss_fn)
                if sid is not None and not torch.isfinite(loss).item():
                    found.append(sid)
        module.train()
        return found or [sid for _, _, sid in suspects]

    def _bad_samples_through_stages(
        self, microbatches: Sequence[Any], ids: list[list[str]], suspects: list[tuple[int, int, str]]
    ) -> list[str]:
        """:meth:`_bad_samples` under pipeline parallelism: the suspects' one-sample forwards run
        through every stage of the pipeline (forward only, as validation runs), all of them in one
        pass; every pipeline runs as many as the one with the most suspects (the stages'
        collectives over ``dp``), the others on a sample of their own whose loss is not looked at."""
        trainer = self.trainer
        body: PipelineRuntime = trainer.step_body
        rounds = max(parallel.gather_objects(len(suspects)))
        if not rounds:
            return []
        picked = [(i, j) for i, j, _ in suspects] + [(0, 0)] * (rounds - len(suspects))
        samples = [_slice(microbatches[i], j, len(ids[i])) for i, j in picked]
        body.module.eval()  # one sample: no batch statistics
        try:
            with torch.no_grad():
                losses = body.forward_losses(samples, trainer.step_context)
        finally:
            body.module.train()
        found = [sid for (_, _, sid), loss in zip(suspects, losses) if not math.isfinite(loss)]
        return found or [sid for _, _, sid in suspects]

    # ------------------------------------------------------------------ the decision
    def _on_verdict(self, bad_ranks: float) -> None:
        """After the step's agreement, on every rank of every replica group alike: rerun a bad step
        where it went bad, classify it, and record every group's verdicts in every group."""
        if not bad_ranks or self.reruns >= self.max_reruns:
            return
        self.reruns += 1
        trainer = self.trainer
        after_step = _rng_state(trainer.device)  # put back, with the buffers, once decided
        buffers = [b.detach().clone() for b in trainer.model.buffers()]
        here = parallel.agree_any(bool(self.detector.verdict))  # False: bad in another replica group only
        found = trainer.agreement.transport.across_groups(self._attribute(trainer.state, here))
        # A group that names no rank (its gradients went bad in the average over the groups) says
        # nothing when another group names one.
        named = any(v["ranks"] for records in found.values() for v in records["verdicts"])
        for group, records in sorted(found.items()):
            if named:
                records = {**records, "verdicts": [v for v in records["verdicts"] if v["ranks"]]}
            self._record(records, group if len(found) > 1 else None)
        _set_rng_state(after_step)
        with torch.no_grad():  # batch statistics (BatchNorm) as the step left them
            for buffer, saved in zip(trainer.model.buffers(), buffers):
                buffer.copy_(saved)
        self._publish(trainer.state)
        faulty = [v for v in self.faulty if v["step"] == trainer.state.step]
        if faulty and self.on_faulty_rank == "stop":
            names = ", ".join(f"{_ranks(v)} on {v['host']}" for v in faulty)
            raise TrainingAborted(
                f"step {trainer.state.step}: {names} computes wrong (attribution.on_faulty_rank='stop')",
                ExitCode.NAN_ABORT,
            )

    def _attribute(self, state: Any, here: bool) -> dict[str, list]:
        """This replica group's verdicts on the step (none unless ``here``, it went bad here) and
        the rows it quarantines; a group of one replica has the next live group rerun its data."""
        me, replicas = parallel.rank(), self._replicas()
        microbatches = list(state.batch or ())
        own = self._rerun(microbatches, self._rng) if here else None
        loss_bad = here and self.detector.judge(float(self._local_loss)) is not None
        rows = parallel.gather_objects((loss_bad, own.reason if own else None, socket.gethostname()))
        wanted = self.peer_rerun and here and any(reason for _, reason, _ in rows)
        peer: list[str | None] | None = None
        if len(replicas) > 1:
            if wanted:
                i = next(k for k, ranks in enumerate(replicas) if me in ranks)
                t, n = replicas[i].index(me), len(replicas)  # the same tensor-parallel coordinate
                sent = (microbatches, self._rng), replicas[(i + 1) % n][t], replicas[(i - 1) % n][t]
                theirs = self._rerun(*_pass_on(*sent, send_first=i % 2 == 0))
                peer = parallel.gather_objects(theirs.reason)  # peer[p]: the previous replica's data on p
        elif self.peer_rerun:  # every group alike
            peer = self._peer_across((microbatches, self._rng) if wanted else None)
        verdicts: list[dict[str, Any]] = []
        if not here:
            return {"verdicts": verdicts, "quarantined": []}
        # Which replicas went bad: those with a rank whose own loss did; else (a gradient that went
        # bad, reduced over every rank) those whose rerun's own gradients are bad; else none is named.
        suspects = [k for k, ranks in enumerate(replicas) if any(rows[r][0] for r in ranks)] or [
            k for k, ranks in enumerate(replicas) if any(rows[r][1] for r in ranks)
        ]
        data_ranks: list[int] = []
        for k in suspects or [None]:
            ranks = list(replicas[k]) if k is not None else []
            told = [r for r in ranks if rows[r][0]]  # the ranks whose own loss went bad
            rank = ranks[0] if len(ranks) == 1 else told[0] if len(told) == 1 < len(ranks) else None
            host = ", ".join(sorted({rows[r][2] for r in ([rank] if rank is not None else ranks)}))
            reason = next((rows[r][1] for r in ranks if rows[r][1]), None)
            if reason is None:
                cause = "transient"
            elif peer is None or any(peer[p] for p in replicas[(k + 1) % len(replicas)]):
                cause = "data"
                data_ranks.extend(ranks)
            else:
                cause = "faulty_rank"
            verdict = {"step": state.step, "rank": rank, "ranks": ranks, "host": host, "reason": reason}
            verdicts.append({**verdict, "cause": cause, "peer": peer is not None})
        quarantined: list[dict[str, Any]] = []
        if data_ranks and self.quarantine:
            mine = self._bad_samples(microbatches, own.bad_microbatches, me in data_ranks)
            ids = sorted({i for ids in parallel.gather_objects(mine) for i in ids})
            reason = f"bad on rank and peer rerun: {next(rows[r][1] for r in data_ranks if rows[r][1])}"
            by_dataset: dict[str, list[str]] = {}
            for sid in ids:
                by_dataset.setdefault(sid.rpartition(":")[0], []).append(sid)
            quarantined = [
                {"step": state.step, "dataset": d, "ids": v, "reason": reason} for d, v in by_dataset.items()
            ]
        return {"verdicts": verdicts, "quarantined": quarantined}

    def _peer_across(self, sent: Any) -> list[str | None] | None:
        """A group of one replica has no peer of its own: the next live replica group reruns its
        microbatches (``sent``; None: nothing to rerun) on its weights, through the agreement's
        transport. This rank's verdict on it per rank of the group; None with one live group."""
        transport = self.trainer.agreement.transport
        received = transport.across_groups(sent)
        live = sorted(received)
        if len(live) < 2:
            return None
        i = live.index(transport.group)
        theirs = received[live[i - 1]]
        reason = self._rerun(*theirs).reason if theirs is not None else None
        return parallel.gather_objects(transport.across_groups(reason)[live[(i + 1) % len(live)]])

    def _record(self, records: dict[str, list], group: int | None) -> None:
        """A group's verdicts and quarantine, alike in every group (``group``: whose, when several)."""
        for verdict in records["verdicts"]:
            verdict = {**verdict, "group": group} if group is not None else verdict
            self.verdicts.append(verdict)
            who = _who(verdict["rank"], verdict["ranks"], verdict["host"] or "unknown host", self._kind)
            who = f"replica group {group}: {who}" if group is not None else who
            if verdict["cause"] == "transient":
                self.transients[who] = self.transients.get(who, 0) + 1
            elif verdict["cause"] == "faulty_rank":
                self.faulty.append({k: v for k, v in verdict.items() if k not in ("cause", "peer")})
            logger.warning("step %d: %s", verdict["step"], _explain(verdict, who))
        if records["quarantined"]:
            self._quarantine(records["quarantined"])

    def _replicas(self) -> list[tuple[int, ...]]:
        """The ranks of each data-parallel replica, in order: one rank each, or under tensor
        parallelism the group of ranks that computes a replica's step together, under pipeline
        parallelism the ranks of its pipeline (all its stages, and their tensor-parallel ranks),
        found once."""
        if self._replica_ranks is None and isinstance(self.trainer.step_body, PipelineRuntime):
            coordinates = parallel.gather_objects(self.trainer.step_body.dp_rank)
            self._kind = "pipeline"
            self._replica_ranks = [
                tuple(r for r, c in enumerate(coordinates) if c == k) for k in sorted(set(coordinates))
            ]
        if self._replica_ranks is None:
            tp = self.trainer.tp_mesh
            mine = (parallel.rank(),)
            if tp is not None and tp.size() > 1:
                mine = tuple(dist.get_process_group_ranks(tp.get_group()))
            self._replica_ranks = sorted(set(parallel.gather_objects(mine)))
        return self._replica_ranks

    def _quarantine(self, rows: list[dict[str, Any]]) -> None:
        """Record ``rows`` (every rank alike), write them (rank 0) and stop fetching their ids."""
        ids = [sid for row in rows for sid in row["ids"]]
        self.quarantined.extend(rows)
        self._skip(ids)
        if self.run_dir is not None and parallel.rank() == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / QUARANTINE_FILE, "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        logger.warning("step %d: quarantined %d sample(s): %s", rows[0]["step"], len(ids), ", ".join(ids))

    def _skip(self, ids: list[str]) -> None:
        if self.loader is not None:
            self.loader.quarantine(ids)

    def _publish(self, state: Any) -> None:
        state.metrics["attribution/reruns"] = self.reruns
        state.metrics["attribution/transients"] = sum(self.transients.values())
        state.metrics["attribution/faulty_ranks"] = len(self.faulty)
        state.metrics["attribution/quarantined"] = sum(len(row["ids"]) for row in self.quarantined)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "reruns": self.reruns,
            "transients": dict(self.transients),
            "faulty": list(self.faulty),
            "quarantined": list(self.quarantined),
            "verdicts": list(self.verdicts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reruns = int(state["reruns"])
        self.transients = dict(state["transients"])
        self.faulty = list(state["faulty"])
        self.quarantined = list(state["quarantined"])
        self.verdicts = list(state["verdicts"])
        self._skip([sid for row in self.quarantined for sid in row["ids"]])


def _pass_on(obj: Any, dst: int, src: int, *, send_first: bool) -> Any:
    """Send ``obj`` to rank ``dst`` and return rank ``src``'s (around a ring of replicas); every
    other replica sends first, so no two ranks wait on each other."""
    received: list[Any] = [None]
    for sending in (send_first, not send_first):
        if sending:
            dist.send_object_list([obj], dst=dst)
        else:
            dist.recv_object_list(received, src=src)
    return received[0]


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state and, on a GPU, the device's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def _slice(microbatch: Any, j: int, size: int) -> Any:
    """Sample ``j`` of a collated microbatch of ``size`` samples (tensors cut along their first
    dimension; anything else kept)."""
    if isinstance(microbatch, torch.Tensor):
        return microbatch[j : j + 1] if microbatch.dim() and microbatch.shape[0] == size else microbatch
    if isinstance(microbatch, tuple | list):
        return type(microbatch)(_slice(x, j, size) for x in microbatch)
    if isinstance(microbatch, dict):
        return {k: _slice(v, j, size) for k, v in microbatch.items()}
    return microbatch


def _ranks(verdict: dict[str, Any]) -> str:
    ranks = verdict.get("ranks") or [verdict["rank"]]
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _who(rank: int | None, ranks: list[int], host: str, kind: str = "tensor-parallel group") -> str:
    """A bad replica as the operator reads it: its rank, or the ranks of its ``kind`` (its
    tensor-parallel group or its pipeline; the one whose own loss went bad when only one did)."""
    if not ranks:
        return "unknown rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]} ({host})"
    group = "ranks " + ", ".join(map(str, ranks))
    if rank is not None:
        return f"rank {rank} ({host}) of the {kind} of {group}"
    return f"{group} ({host}), one {kind}: which of its ranks cannot be told"


def _explain(verdict: dict[str, Any], who: str) -> str:
    cause, reason = verdict["cause"], verdict["reason"]
    if cause == "transient":
        return f"{who} was bad and its rerun is good: a transient fault, counted"
    if cause == "faulty_rank":
        return (
            f"{who} is bad ({reason}) again on its rerun, and its data is good on another replica: it "
            "computes wrong; leave its node out"
        )
    where = "on its rerun and on another replica" if verdict["peer"] else "on its rerun"
    return f"{who} is bad ({reason}) {where}: the data or the numerics; samples quarantined"
