"""Configuration: files, overrides, and one clear ConfigError per bad value, naming the field."""

import ast
import dataclasses
import math
import os
import sys

import pytest

from hookloop.engine import ConfigError
from hookloop.engine.checks import check_bool, check_choice, check_int, check_number, dotted
from hookloop.engine.config import DistributedConfig, LRConfig, OptimizerConfig, TrainConfig, load_config
from hookloop.engine.data.config import DataConfig, PhaseConfig
from hookloop.handlers import RunConfig, load_run_config
from hookloop.handlers.health_check import HealthConfig
from tests.dist_utils import REPO, run_process

YAML = """
model: {n_layers: 2, d_model: 64}
train: {local_batch_size: 4, seq_len: 32}
optimizer: {lr: 0.001}
step_scheduler: {global_batch_size: 8, max_steps: 20}
"""

TOML = """
[train]
local_batch_size = 4
[step_scheduler]
global_batch_size = 16
max_steps = 7
[data.weights]
docs = 2.0
"""


def test_yaml_toml_and_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text(YAML)
    cfg = load_run_config(y, ["step_scheduler.max_steps=50", "lr.warmup_steps=5"], world_size=1)
    assert isinstance(cfg, RunConfig)
    assert cfg.model == {"n_layers": 2, "d_model": 64}
    assert cfg.step_scheduler.max_steps == 50 and cfg.lr.warmup_steps == 5
    assert cfg.train.local_batch_size == 4 and cfg.optimizer.lr == 0.001
    t = tmp_path / "c.toml"
    t.write_text(TOML)
    cfg = load_run_config(t, world_size=2)
    assert cfg.step_scheduler.max_steps == 7 and cfg.data.weights == {"docs": 2.0}


def test_example_configs_load():
    cfg = load_run_config("examples/configs/gpt_tiny.yaml", world_size=1)
    assert cfg.model["n_layers"] >= 1
    cfg = load_run_config("examples/configs/gpt_mixture.yaml", world_size=1)
    assert [p.start_step for p in cfg.data.phases] == [0, 100]


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["train.no_such_key=1"], "train.no_such_key"),
        (["nosection.x=1"], "nosection"),
        (["train.local_batch_size=abc"], "train.local_batch_size"),
        (["train.local_batch_size=0"], "train.local_batch_size"),
        (["train.max_steps=10"], "train.max_steps"),
        (["step_scheduler.max_steps"], "step_scheduler.max_steps"),
        (["step_scheduler.max_steps=-3"], "step_scheduler.max_steps"),
        (
            ["step_scheduler.global_batch_size=12", "train.local_batch_size=8"],
            "step_scheduler.global_batch_size",
        ),
        (["step_scheduler.ckpt_every_steps=0"], "step_scheduler.ckpt_every_steps"),
        (["step_scheduler.stop_signals=[SIGKILL]"], "step_scheduler.stop_signals"),
        (["optimizer.name=lamb"], "optimizer.name"),
        (["optimizer.lr=0"], "optimizer.lr"),
        (["optimizer.betas=[0.9]"], "optimizer.betas"),
        (["lr.decay_style=cosine", "step_scheduler.max_steps=null"], "lr.decay_steps"),
        (["lr.decay_style=WSD", "step_scheduler.max_steps=10"], "lr.wsd_decay_steps"),
        (["lr.warmup_steps=30", "step_scheduler.max_steps=10"], "lr.warmup_steps"),
        (["lr.min_lr=1.0"], "lr.min_lr"),
        (["distributed.dp_mode=zero3"], "distributed.dp_mode"),
        (["distributed.pp_size=3"], "distributed.pp_size"),
        (["checkpoint.mode=fast"], "checkpoint.mode"),
        (["checkpoint.keep_last=0"], "checkpoint.keep_last"),
        (["checkpoint.wait_timeout_s=0"], "checkpoint.wait_timeout_s"),
        (["nan.action=ignore"], "nan.action"),
        (["nan.spike_factor=0.5"], "nan.spike_factor"),
        (["checkpoint.enabled=false"], "nan.action"),
        (["data.weights.nope=1.0"], "data.weights.nope"),
        (["data.weights.docs=-1"], "data.weights.docs"),
        (["data.weights.docs=0"], "data.weights"),
        (["data.mix_temperature=0"], "data.mix_temperature"),
        (["logging.log_interval=0"], "logging.log_interval"),
        (["logging.wandb_mode=sometimes"], "logging.wandb_mode"),
        (["metrics.flops_per_token=-1"], "metrics.flops_per_token"),
        (["dataset_metrics.log_interval=0"], "dataset_metrics.log_interval"),
        (["profiling.start_step=5", "profiling.end_step=5"], "profiling.end_step"),
        (["profiling.ranks=[-1]"], "profiling.ranks"),
        (["health.timeout_s=-1"], "health.timeout_s"),
        (["straggler.stop_threshold=1.0"], "straggler.stop_threshold"),
    ],
)
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        load_run_config(None, ["step_scheduler.max_steps=100", *overrides], world_size=2)
    assert info.value.field == field, str(info.value)
    assert field in str(info.value)


@pytest.mark.parametrize(
    "section,key,replacement",
    [
        ("checkpoint", "every_steps", "step_scheduler.ckpt_every_steps"),
        ("step_scheduler", "log_remote_every_steps", "logging.log_interval"),
        ("logging", "wandb_every_steps", "logging.log_interval"),
    ],
)
def test_a_removed_cadence_key_names_its_replacement_in_a_file_and_an_override(
    tmp_path, section, key, replacement
):
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {key}: 5\n")
    for args in ((path, []), (None, [f"{section}.{key}=5"])):
        with pytest.raises(ConfigError) as info:
            load_run_config(*args, world_size=1)
        assert info.value.field == f"{section}.{key}"
        assert str(info.value) == f"{section}.{key}: is not a setting here; use {replacement}"


def test_the_removed_fault_section_names_the_fault_injection_keys(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("fault:\n  nan_microbatches: [3]\n")
    new_keys = "use fault_injection.enabled=true fault_injection.kind=nan fault_injection.microbatches=[...]"
    old = "fault.nan_microbatches"
    for args, field in (((path, []), "fault"), ((None, [f"{old}=[3]"]), old)):
        with pytest.raises(ConfigError) as info:
            load_run_config(*args, world_size=1)
        assert str(info.value) == f"{field}: is not a setting here; {new_keys}"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", ".nan", ".inf"])
@pytest.mark.parametrize(
    "key", ["optimizer.weight_decay", "lr.min_lr", "lr.warmup_init", "health.timeout_s", "data.val_fraction"]
)
def test_nan_and_infinity_are_rejected(key, value):
    with pytest.raises(ConfigError, match="finite") as info:
        load_run_config(None, ["step_scheduler.max_steps=100", f"{key}={value}"], world_size=1)
    assert info.value.field == key


@pytest.mark.parametrize(
    "section,name,bad",
    [
        (OptimizerConfig, "weight_decay", "0.1"),
        (OptimizerConfig, "lr", "1e-3"),
        (LRConfig, "min_lr", "0"),
        (LRConfig, "warmup_steps", "10"),
        (TrainConfig, "local_batch_size", "10"),
        (TrainConfig, "grad_clip_norm", [1.0]),
        (DistributedConfig, "timeout_s", "600"),
        (HealthConfig, "timeout_s", "10"),
        (HealthConfig, "every_steps", 2.5),
        (DataConfig, "mix_temperature", None),
    ],
)
def test_wrong_types_are_config_errors_not_type_errors(section, name, bad):
    cfg = section(**{name: bad})
    prefix = {OptimizerConfig: "optimizer", LRConfig: "lr", TrainConfig: "train"}.get(section)
    prefix = prefix or {DistributedConfig: "distributed", HealthConfig: "health", DataConfig: "data"}[section]
    with pytest.raises(ConfigError) as info:
        cfg.validate(prefix)
    assert info.value.field == f"{prefix}.{name}"
    if isinstance(bad, str):
        assert "without quotes" in str(info.value)


def test_bad_phases_name_the_field():
    base = ["step_scheduler.max_steps=100"]
    cases = [
        ("data.phases=[{start_step: 5}, {start_step: 5}]", "data.phases[1].start_step"),
        ("data.phases=[{start_step: 0, dataset_weights: {zzz: 1.0}}]", "data.phases[0].dataset_weights.zzz"),
        (
            "data.phases=[{start_step: 0, dataset_weights: {docs: -2.0}}]",
            "data.phases[0].dataset_weights.docs",
        ),
        ("data.phases=[{start_step: 0, dataset_weights: {docs: 0.0}}]", "data.phases[0].dataset_weights"),
        ("data.phases=[{start_step: 0, lr_scale: 0}]", "data.phases[0].lr_scale"),
        ("data.phases=[{start_step: 0, lr_scale: .inf}]", "data.phases[0].lr_scale"),
    ]
    for override, field in cases:
        with pytest.raises(ConfigError) as info:
            load_run_config(None, [*base, override], world_size=1)
        assert info.value.field == field, str(info.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_run_config(bad)
    txt = tmp_path / "c.txt"
    txt.write_text("x")
    with pytest.raises(ConfigError, match=r"\.yaml"):
        load_run_config(txt)


def test_type_errors_point_at_the_section_dataclass():
    with pytest.raises(ConfigError, match=r"handlers\.sections\.nan\.NaNConfig"):
        load_run_config(None, ["nan.max_consecutive=lots"])
    with pytest.raises(ConfigError, match="sections of RunConfig are: model, train"):
        load_run_config(None, ["nosection.x=1"])


# ------------------------------------------------------------------------------ the generic loader


@dataclasses.dataclass
class _Tiny:
    every: int = 3

    def validate(self, prefix: str) -> None:
        check_int(f"{prefix}.every", self.every)


@dataclasses.dataclass
class _Schema:
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    tiny: _Tiny = dataclasses.field(default_factory=_Tiny)
    checked_with: list = dataclasses.field(default_factory=list)

    def validate(self, world_size):
        self.checked_with.append(world_size)


def test_load_config_validates_any_schema_section_by_section():
    cfg = load_config(None, ["tiny.every=5"], schema=_Schema, world_size=3)
    assert cfg.tiny.every == 5 and cfg.checked_with == [3]
    with pytest.raises(ConfigError) as info:
        load_config(None, ["tiny.every=0"], schema=_Schema)
    assert info.value.field == "tiny.every"
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.seq_len=0"], schema=_Schema)
    assert info.value.field == "train.seq_len"
    with pytest.raises(TypeError, match="dataclass"):
        load_config(None, schema=dict)


# ------------------------------------------------------------------------------ checks


def test_checks_name_the_field_and_reject_what_they_should():
    assert dotted("nan", "action") == "nan.action" and dotted("", "action") == "action"
    check_int("a", 0, low=0)
    check_int("a", None, allow_none=True)
    check_number("b", 0.5, low=0, below=1)
    check_number("b", 2, above=1)
    check_choice("c", "x", ("x", "y"))
    check_bool("d", None, allow_none=True)
    for call, field in [
        (lambda: check_int("a", True), "a"),
        (lambda: check_int("a", 1.0), "a"),
        (lambda: check_int("a", "1"), "a"),
        (lambda: check_int("a", 5, high=4), "a"),
        (lambda: check_number("b", math.nan), "b"),
        (lambda: check_number("b", -math.inf), "b"),
        (lambda: check_number("b", False), "b"),
        (lambda: check_number("b", 0, positive=True), "b"),
        (lambda: check_number("b", 1, above=1), "b"),
        (lambda: check_number("b", 1, below=1), "b"),
        (lambda: check_choice("c", ["x"], ("x",)), "c"),  # unhashable: not a choice, no TypeError
        (lambda: check_bool("d", 1), "d"),
    ]:
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.field == field


def test_data_section_shares_the_phase_rules():
    cfg = DataConfig(datasets={"docs": "stdlib_docs"}, phases=[PhaseConfig(3, {"docs": 1.0}), PhaseConfig(3)])
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert info.value.field == "data.phases[1].start_step"


# ------------------------------------------------------------------------------ removed names


def test_old_names_are_gone_and_load_config_needs_a_schema():
    import hookloop.engine
    import hookloop.engine.config

    for module, name in [
        (hookloop.engine, "HookloopConfig"),
        (hookloop.engine, "validate_config"),
        (hookloop.engine.config, "StepSchedulerConfig"),
    ]:
        with pytest.raises(AttributeError):
            getattr(module, name)
    with pytest.raises(TypeError, match="schema"):
        hookloop.engine.config.load_config(None, ["step_scheduler.max_steps=10"])  # no schema=


def test_engine_config_does_not_import_handlers():
    for module in ("engine/config.py", "engine/__init__.py", "engine/checks.py", "engine/data/config.py"):
        tree = ast.parse((REPO / module).read_text())
        imported = [
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        ] + [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert not [m for m in imported if m.split(".")[0] == "handlers"], module
    code = (
        "import dataclasses, sys, engine\n"
        "from engine.config import TrainConfig, load_config\n"
        "train = ('train', TrainConfig, dataclasses.field(default_factory=TrainConfig))\n"
        "S = dataclasses.make_dataclass('S', [train])\n"
        "assert load_config(None, ['train.seq_len=8'], schema=S).train.seq_len == 8\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'handlers'))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = run_process([sys.executable, "-c", code], env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_config_files_datasets_replace_the_default(tmp_path):
    """``data.datasets`` in a file is the run's dataset list (not added to the default docs entry);
    command-line overrides add or replace one entry."""
    path = tmp_path / "mine.yaml"
    path.write_text("step_scheduler:\n  max_steps: 5\ndata:\n  datasets:\n    mine: x.u8\n")
    assert load_run_config(path, world_size=1).data.datasets == {"mine": "x.u8"}
    both = load_run_config(path, ["data.datasets.code=stdlib_source"], world_size=1)
    assert both.data.datasets == {"mine": "x.u8", "code": "stdlib_source"}
    plain = tmp_path / "plain.yaml"
    plain.write_text("step_scheduler:\n  max_steps: 5\n")
    assert load_run_config(plain, ["data.datasets.mine=y"], world_size=1).data.datasets == {
        "docs": "stdlib_docs",
        "mine": "y",
    }
