"""Pipeline parallelism: :class:`PipelineConfig`, stage splitting, schedules, and the PP step body.

Typical use (under ``torchrun``)::

    info = init_distributed(mesh_shape=(world // pp, pp), mesh_dim_names=("dp", "pp"))
    runtime = build_pipeline(model, PipelineConfig(pp_schedule="1f1b", pp_batch_size=8), info)
    optimizer = torch.optim.AdamW(runtime.parameters())
    trainer = Trainer(runtime.module, optimizer, loss_fn, step_body=runtime)

Importing this package is cheap: ``torch.distributed.pipelining`` (about two seconds) is imported
only when a schedule is looked up or built.
"""

from typing import TYPE_CHECKING

from hookloop.engine.lazy import homes_of, lazy_exports

if TYPE_CHECKING:  # what editors and type checkers see; at run time, __getattr__ below
    from hookloop.engine.pipeline.config import PipelineConfig, bubble_fraction
    from hookloop.engine.pipeline.runtime import PipelineRuntime, build_pipeline
    from hookloop.engine.pipeline.schedules import available_schedules, parse_schedule_csv, resolve_schedule
    from hookloop.engine.pipeline.split import default_module_fqns, plan_stages, split_stage_module

# Where each public name lives: imported on first use (PEP 562), so the config's rules
# (:mod:`.config`) load without torch.
_MODULES = {
    "config": ("PipelineConfig", "bubble_fraction"),
    "runtime": ("PipelineRuntime", "build_pipeline"),
    "schedules": ("available_schedules", "parse_schedule_csv", "resolve_schedule"),
    "split": ("default_module_fqns", "plan_stages", "split_stage_module"),
}
_HOMES = homes_of(__name__, _MODULES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)


__all__ = [
    "PipelineConfig",
    "PipelineRuntime",
    "available_schedules",
    "bubble_fraction",
    "build_pipeline",
    "default_module_fqns",
    "parse_schedule_csv",
    "plan_stages",
    "resolve_schedule",
    "split_stage_module",
]
