"""Configuration: files, overrides, and one clear ConfigError per bad value, naming the field."""

import pytest

from engine import ConfigError, HookloopConfig, load_config

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
    cfg = load_config(y, ["step_scheduler.max_steps=50", "lr.warmup_steps=5"], world_size=1)
    assert isinstance(cfg, HookloopConfig)
    assert cfg.model == {"n_layers": 2, "d_model": 64}
    assert cfg.step_scheduler.max_steps == 50 and cfg.lr.warmup_steps == 5
    assert cfg.train.local_batch_size == 4 and cfg.optimizer.lr == 0.001
    t = tmp_path / "c.toml"
    t.write_text(TOML)
    cfg = load_config(t, world_size=2)
    assert cfg.step_scheduler.max_steps == 7 and cfg.data.weights == {"docs": 2.0}


def test_example_config_loads():
    cfg = load_config("examples/configs/gpt_tiny.yaml", world_size=1)
    assert cfg.model["n_layers"] >= 1


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
        (["optimizer.name=lamb"], "optimizer.name"),
        (["optimizer.lr=0"], "optimizer.lr"),
        (["lr.decay_style=cosine", "step_scheduler.max_steps=null"], "lr.decay_steps"),
        (["lr.decay_style=WSD", "step_scheduler.max_steps=10"], "lr.wsd_decay_steps"),
        (["lr.warmup_steps=30", "step_scheduler.max_steps=10"], "lr.warmup_steps"),
        (["lr.min_lr=1.0"], "lr.min_lr"),
        (["distributed.dp_mode=zero3"], "distributed.dp_mode"),
        (["distributed.pp_size=3"], "distributed.pp_size"),
        (["checkpoint.mode=fast"], "checkpoint.mode"),
        (["checkpoint.keep_last=0"], "checkpoint.keep_last"),
        (["nan.action=ignore"], "nan.action"),
        (["nan.spike_factor=0.5"], "nan.spike_factor"),
        (["checkpoint.enabled=false"], "nan.action"),
        (["data.weights.nope=1.0"], "data.weights.nope"),
        (["data.weights.docs=-1"], "data.weights.docs"),
        (["data.weights.docs=0"], "data.weights"),
        (["data.mix_temperature=0"], "data.mix_temperature"),
        (["logging.log_interval=0"], "logging.log_interval"),
        (["profiling.start_step=5", "profiling.end_step=5"], "profiling.end_step"),
        (["health.timeout_s=-1"], "health.timeout_s"),
    ],
)
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["step_scheduler.max_steps=100", *overrides], world_size=2)
    assert info.value.field == field, str(info.value)
    assert field in str(info.value)


def test_bad_phases_name_the_field():
    base = ["step_scheduler.max_steps=100"]
    cases = [
        ("data.phases=[{start_step: 5}, {start_step: 5}]", "data.phases[1].start_step"),
        ("data.phases=[{start_step: 0, dataset_weights: {zzz: 1.0}}]", "data.phases[0].dataset_weights.zzz"),
        (
            "data.phases=[{start_step: 0, dataset_weights: {docs: -2.0}}]",
            "data.phases[0].dataset_weights.docs",
        ),
        ("data.phases=[{start_step: 0, lr_scale: 0}]", "data.phases[0].lr_scale"),
    ]
    for override, field in cases:
        with pytest.raises(ConfigError) as info:
            load_config(None, [*base, override], world_size=1)
        assert info.value.field == field, str(info.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    txt = tmp_path / "c.txt"
    txt.write_text("x")
    with pytest.raises(ConfigError, match=r"\.yaml"):
        load_config(txt)
