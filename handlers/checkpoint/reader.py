"""Choosing and reading a checkpoint without trusting it: the checkpoint every rank agrees to load
(verified against its manifest, each rank checking a share; damaged ones named and skipped), the
layout check before anything is read into the model, and DCP's load through the safe reader."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from hookloop.engine import parallel
from hookloop.engine.checkpoint_format.directory import MARKER, parse_step, resolve_checkpoint
from hookloop.engine.checkpoint_format.errors import (
    CheckpointError,
    CheckpointIndexBoundError,
    CheckpointLayoutError,
)
from hookloop.engine.checkpoint_format.safe_read import SafeLoadPlanner, SafeReader, verify_checkpoint
from hookloop.handlers.checkpoint import optim_layout
from hookloop.handlers.checkpoint.dcp_calls import last_line, quiet_single_process
from hookloop.handlers.checkpoint.handler_tensors import HANDLERS
from hookloop.handlers.checkpoint.model_layout import (
    STAGE_PREFIX,
    back_to_names,
    describe_layout_difference,
    names_across_split,
    stored_under_these_names,
    under_names,
)
from hookloop.handlers.checkpoint.session import CheckpointSession
from hookloop.handlers.checkpoint.store import CheckpointStore, not_finite

__all__ = ["CheckpointReader", "resolve_checkpoint_setting"]

logger = logging.getLogger("hookloop.handlers.checkpoint")


class CheckpointReader:
    """Agrees on, verifies and loads checkpoints (collective where it says so).

    Args:
        store: lists the candidates to load, newest first.
        session: the checkpoint process group the ranks agree on.
        index_limit: the largest DCP index (``.metadata``) read, in bytes.
    """

    def __init__(
        self,
        store: CheckpointStore,
        session: CheckpointSession,
        *,
        index_limit: int,
        long_wait: Callable[[], Any],
    ) -> None:
        self._store = store
        self._session = session
        self.index_limit = index_limit
        self._long_wait = long_wait

    def agreed_checkpoint(
        self,
        which: str,
        field: str = "checkpoint.resume",
        at_or_before: int | None = None,
        finite_only: bool = False,
        check: Callable[[str], list[str]] | None = None,
    ) -> str | None:
        """The checkpoint every rank loads, after verifying its manifest (collective).

        ``"auto"``: the newest intact complete checkpoint in ``directory``, None when there is no
        complete one at all. A path: that checkpoint or, when it is damaged, the next older intact
        one beside it. A damaged checkpoint is named in a warning and the next older one is tried;
        CheckpointError when every candidate is damaged. Rank 0 lists the candidates; each rank
        verifies its share of a candidate's files and the ranks exchange what they found, so all of
        them take the same decision even when only one of them saw the damage. ``finite_only``
        (a rollback): checkpoints whose marker records NaN/Inf in the saved parameters or optimizer
        state are skipped too. ``check``: what else is wrong with a candidate on this rank (the rank
        state file it would load), damage like the rest.

        An intact checkpoint whose index is over ``index_limit`` (``checkpoint.max_index_mb``) is no
        damage: CheckpointIndexBoundError naming the value to set, and no older checkpoint is tried
        (loading one would silently drop the steps since)."""
        if which != "auto":
            resolved = resolve_checkpoint_setting(which, field)
            if resolved != which:  # a directory of checkpoints: its newest intact one
                if parallel.rank() == 0:
                    logger.info(
                        "%s %s is a directory of checkpoints: loading its newest intact checkpoint",
                        field,
                        which,
                    )
                which = resolved
        listing: list[Any] = [[], None]
        if parallel.rank() == 0:
            try:
                listing[0] = [
                    path
                    for path in self._store.candidates(which)
                    if at_or_before is None or (parse_step(os.path.basename(path)) or 0) <= at_or_before
                ]
                if finite_only:
                    for path in [path for path in listing[0] if not_finite(path)]:
                        logger.warning(
                            "not rolling back to %s: its parameters or optimizer state held NaN/Inf "
                            "when it was saved",
                            path,
                        )
                        listing[0].remove(path)
            except OSError as e:
                listing[1] = f"cannot list the checkpoints in {which}: {e}"
        if self._session.group is not None:
            dist.broadcast_object_list(listing, src=0, group=self._session.group)
        candidates, listing_error = listing
        if listing_error is not None:
            raise CheckpointError(f"{listing_error}; fix the permissions of checkpoint.directory")
        damaged: list[str] = []
        for path in candidates:
            problems, verified, over = self._verify_agreed(path, check)
            if over is not None and not problems:
                raise CheckpointIndexBoundError(
                    path,
                    *over,
                    f"to {'roll back to' if finite_only else 'load'} it (nothing was loaded; older "
                    "checkpoints are not tried in its place, which would drop the steps since)",
                )
            if problems:
                damaged.append(path)
                logger.warning(
                    "checkpoint %s is damaged (%s); trying the next older complete checkpoint",
                    path,
                    "; ".join(problems),
                )
                continue
            if damaged:
                logger.warning("loading %s instead of the damaged %s", path, ", ".join(damaged))
            if not verified:
                logger.warning(
                    "checkpoint %s has no manifest in its %s marker (written by an earlier version): "
                    "loading it unverified",
                    path,
                    MARKER,
                )
            return path
        if damaged:
            raise CheckpointError(
                f"every complete checkpoint to load from is damaged: {', '.join(damaged)} (the warnings "
                "above name what is wrong with each); restore them from a copy, or move them away to "
                "start fresh"
            )
        return None

    def _verify_agreed(
        self, path: str, check: Callable[[str], list[str]] | None = None
    ) -> tuple[list[str], bool, tuple[int, int] | None]:
        """Every rank's problems with ``path`` (each rank checks its share of the files, and what
        ``check`` says), whether it has a manifest at all, and ``(size, limit)`` of its index when
        that is intact but over the bound; identical on every rank."""
        rank, world = (parallel.rank(), parallel.world_size()) if self._session.group is not None else (0, 1)
        over = None
        try:
            with self._long_wait():  # reading the checkpoint back: local, long on slow storage
                try:
                    problems, verified = verify_checkpoint(path, rank, world, self.index_limit)
                except CheckpointIndexBoundError as e:
                    problems, verified, over = [], True, (e.size, e.limit)
                if check is not None:
                    problems = [*problems, *check(path)]
        except Exception as e:  # noqa: BLE001 - must still join the exchange below, or the peers hang
            problems, verified = [f"verifying it failed: {type(e).__name__}: {e}"], True
        if self._session.group is None:
            return problems, verified, over
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (problems, verified, over), group=self._session.group)
        everyone = [
            p if world == 1 else f"rank {r}: {p}" for r, (ps, _, _) in enumerate(gathered) for p in ps
        ]
        over = next((o for _, _, o in gathered if o is not None), None)
        return everyone, all(v for _, v, _ in gathered), over

    def _check_compatible(
        self, path: str, index: Any, state_dict: dict[str, Any], field: str
    ) -> dict[str, str] | None:
        """Refuse, before anything is read into the model, a checkpoint whose model parameters are
        not this model's (other layers or widths). The verdict is taken on every rank from the union
        of the ranks' parameters, so all ranks raise together. A checkpoint of the same model
        written with pipeline stages and loaded without them (or the reverse) is this model's
        under other names: the map from this rank's parameter names to the checkpoint's is
        returned (None when the names are the same)."""
        stored = {
            k.removeprefix("model."): tuple(getattr(v, "size", ()))
            for k, v in index.state_dict_metadata.items()
            if k.startswith("model.")
        }
        wanted = {k: tuple(v.shape) for k, v in state_dict["model"].items() if isinstance(v, torch.Tensor)}
        # ranks may hold different parts (pipeline stages): the union counts
        if self._session.group is not None:
            gathered: list[Any] = [None] * parallel.world_size()
            dist.all_gather_object(gathered, wanted, group=self._session.group)
            for part in gathered:
                wanted.update(part)
        if stored == wanted:
            return None
        names = names_across_split(stored, wanted)
        if names is not None:
            return {k: names[k] for k in state_dict["model"]}
        difference = describe_layout_difference(stored, wanted)
        if difference is None:
            return None
        error = CheckpointLayoutError(
            field,
            f"checkpoint {path} holds another model layout: {difference}; resume it with the settings "
            "that wrote it, or start a fresh run with train.run_dir=<new dir> (checkpoint.resume=null "
            "also starts fresh, but saves over this directory's checkpoints); nothing was loaded or "
            "changed",
        )
        error.difference = difference
        raise error

    def load(
        self,
        path: str,
        state_dict: dict[str, Any],
        field: str = "checkpoint.resume",
        handlers: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        """Load ``path`` into ``state_dict`` (``model``, ``optim``) in place, after the layout
        check. ``handlers``: given the checkpoint's index entries, the handler tensor state to load
        (:func:`.handler_tensors.targets`), put into ``state_dict[HANDLERS]`` and filled too."""
        index = SafeReader(path, index_limit=self.index_limit).read_metadata()
        names = self._check_compatible(path, index, state_dict, field)
        stored = index.state_dict_metadata
        if names is not None:  # handler tensors named after parameters, under this model's names
            stored = stored_under_these_names(stored, names, f"{HANDLERS}.")
        if handlers is not None and (tensors := handlers(stored)):
            state_dict[HANDLERS] = tensors
        target = state_dict if names is None else under_names(state_dict, names)
        # the optimizer's settings as the checkpoint holds them: per group or per parameter
        stored = index.state_dict_metadata
        expand = optim_layout.request(target["optim"], stored, path) if "optim" in target else None
        if names is not None:
            logger.info(
                "%s was written %s pipeline stages: loading its parameters and optimizer state by name",
                path,
                "without" if any(STAGE_PREFIX.match(k) for k in names) else "with",
            )
        with quiet_single_process():
            try:
                dcp.load(
                    target,
                    storage_reader=SafeReader(path, index_limit=self.index_limit),
                    planner=SafeLoadPlanner(),
                    process_group=self._session.group,
                    no_dist=self._session.group is None,
                )
            except CheckpointError:
                raise
            except (Exception, CheckpointException) as e:  # DCP's error derives from BaseException
                raise CheckpointError(
                    f"loading {path} failed: {last_line(e)}; if the optimizer changed since it was "
                    "written, resume with load_optimizer=False"
                ) from None
        if expand is not None:
            expand()
        if names is not None:  # DCP replaced the non-tensor values (hyper-parameters) in target
            back_to_names(target, state_dict, names)

    def load_weights(self, model: torch.nn.Module, path: str) -> None:
        """Load only the model weights of ``path`` into ``model`` (``finetune_from``)."""
        state_dict = {"model": get_model_state_dict(model)}
        self.load(path, state_dict, "checkpoint.finetune_from")
        try:
            set_model_state_dict(model, state_dict["model"])
        except Exception as e:
            raise CheckpointError(f"loading the model weights of {path} failed: {last_line(e)}") from e
        logger.info("fine-tuning from the model weights of %s (starting at step 0)", path)


def resolve_checkpoint_setting(path: str, field: str) -> str:
    """The complete checkpoint ``path`` names (itself, or the newest complete one in a directory of
    checkpoints); a CheckpointError naming ``field`` otherwise."""
    try:
        return resolve_checkpoint(path)[0]
    except CheckpointError as e:
        raise CheckpointError(f"{field}: {e}") from None
