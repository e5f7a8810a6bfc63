"""A shipped handler is one declaration (issue 46, item 4): its class says its section, its config,
its doc page; its module says its places; its config says the metrics it produces. The run
config's sections, the attach order, ``Places``, the produced metrics, the configuration reference
and the docs' handler table come from those declarations."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import pytest

from hookloop.engine import ConfigError
from hookloop.engine.events import Place
from hookloop.handlers import HANDLER_ORDER, Places, RunConfig, compose_config, load_run_config
from hookloop.handlers.declarations import (
    COMMAND,
    DOCS,
    SHIPPED,
    render_shipped,
    render_table,
    shipped_handlers,
)
from hookloop.handlers.shipped import HANDLERS, SECTIONS
from tests.dist_utils import REPO


def test_the_generated_files_are_current():
    handlers = shipped_handlers(REPO)
    assert (REPO / SHIPPED).read_text() == render_shipped(handlers), f"{SHIPPED} is stale: run {COMMAND}"
    assert render_table(handlers) in (REPO / DOCS).read_text(), f"{DOCS}'s table is stale: run {COMMAND}"


def test_the_shipped_handlers_are_found_by_their_declarations():
    found = shipped_handlers(REPO)
    assert found == HANDLER_ORDER
    assert list(HANDLERS) == [f"{c.__module__}:{c.__qualname__}" for c in found]
    for cls in found:
        assert SECTIONS[cls.section] is cls.Config
        assert getattr(RunConfig(), cls.section).__class__ is cls.Config
        module = sys.modules[cls.__module__]
        for name, value in vars(module).items():
            if isinstance(value, Place):
                assert getattr(Places, name) is value, f"{cls.__name__}'s place {name} is not in Places"
    # the run config: the engine's sections, then the shipped ones in attach order, then handlers
    fields = [f.name for f in dataclasses.fields(RunConfig)]
    shipped = [name for name in SECTIONS if name not in fields[: fields.index("validation") + 1]]
    assert fields[fields.index("validation") + 1 :] == [*shipped, "handlers"]


@dataclass
class ShadowConfig:
    """A section whose handler publishes a metric only when the config says so."""

    enabled: bool = False

    def validate(self, prefix: str = "shadow") -> None:
        pass

    def produces(self, cfg) -> set[str]:
        return {"val_loss_shadow"} if self.enabled and cfg.data.val_fraction > 0 else set()


def test_a_section_says_the_metrics_it_produces_for_checkpoint_metric():
    schema = compose_config(shadow=ShadowConfig)
    ranked = ["checkpoint.keep_best=2", "checkpoint.metric=val_loss_shadow", "step_scheduler.max_steps=10"]
    with pytest.raises(ConfigError, match=r"checkpoint\.metric: 'val_loss_shadow' is not a metric this run"):
        load_run_config(None, ranked, schema=schema, world_size=1)
    cfg = load_run_config(None, [*ranked, "shadow.enabled=true"], schema=schema, world_size=1)
    assert {"val_loss", "val_loss_shadow", "loss_avg", "loss", "grad_norm"} <= cfg.produced_metrics()
    off = ["metrics.enabled=false", "step_scheduler.enabled=false", "lr.decay_style=constant"]
    assert load_run_config(None, off, world_size=1).produced_metrics() == {"loss/docs"}  # dataset_metrics


def test_composing_a_section_that_ships_since_changes_nothing():
    """A handler's tests written before it shipped (``compose_config(<section>=<Config>)``) keep
    working once it does; another dataclass under a shipped section's name is refused."""
    from hookloop.handlers import NaNConfig

    assert compose_config(nan=NaNConfig) is RunConfig
    both = compose_config(nan=NaNConfig, shadow=ShadowConfig)
    assert [f.name for f in dataclasses.fields(both)][-1] == "shadow"
    with pytest.raises(ValueError, match="section 'nan' is already in RunConfig"):
        compose_config(nan=ShadowConfig)


def test_the_readme_s_handler_table_names_every_shipped_handler_with_its_page():
    """The README keeps its own words for each handler; it is checked against the declarations."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("## Handlers") :]
    table = table[: table.index("\n\n", table.index("| handler |"))]
    rows = [row for row in table.splitlines() if row.startswith("| `")]
    for cls in HANDLER_ORDER:
        row = next((r for r in rows if f"`{cls.__name__}`" in r), None)
        assert row is not None, f"README.md's handler table has no row for {cls.__name__}"
        assert f"({cls.doc})" in row, f"README.md's row for {cls.__name__} should link {cls.doc}"
