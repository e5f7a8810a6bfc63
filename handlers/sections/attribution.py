"""The ``attribution`` section (:class:`hookloop.handlers.attribution.RerunAttribution`), torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from hookloop.engine.checks import check_bool, check_choice, check_int, dotted

__all__ = ["AttributionConfig"]

FAULTY_RANK_ACTIONS = ("warn", "stop")


@dataclass
class AttributionConfig:
    """The ``attribution`` section: rerun a bad step to tell bad data from a bad rank (see
    :class:`~hookloop.handlers.attribution.RerunAttribution`; needs the ``nan`` detector, and with
    ``quarantine`` the sample trace, ``data.trace_samples``)."""

    enabled: bool = False  # on: also set data.trace_samples (it names the samples to quarantine)
    max_reruns: int = 10  # bad steps a run reruns at most; later bad steps are only vetoed
    peer_rerun: bool = True  # also rerun a reproducible step's microbatches on another rank
    quarantine: bool = True  # quarantine the samples of a step found bad on every rank
    on_faulty_rank: str = "warn"  # warn (name it, go on) or stop (exit 76, naming rank and host)

    def validate(self, prefix: str = "attribution") -> None:
        """The only copy of the section's rules."""
        check_bool(dotted(prefix, "enabled"), self.enabled)
        check_int(dotted(prefix, "max_reruns"), self.max_reruns, low=0)
        check_bool(dotted(prefix, "peer_rerun"), self.peer_rerun)
        check_bool(dotted(prefix, "quarantine"), self.quarantine)
        check_choice(dotted(prefix, "on_faulty_rank"), self.on_faulty_rank, FAULTY_RANK_ACTIONS)
