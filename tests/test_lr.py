"""LR schedules against closed-form values, through a real optimizer and LambdaLR."""

import math

import pytest
import torch

from hookloop.engine import ConfigError, build_lr_scheduler

PEAK, MIN, INIT = 1.0, 0.1, 0.05


def trace(steps: int, **kwargs) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    sched = build_lr_scheduler(opt, **kwargs)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_then_cosine():
    lrs = trace(25, warmup_steps=5, decay_steps=20, decay_style="cosine", min_lr=MIN, warmup_init=INIT)
    for s in range(6):
        assert lrs[s] == pytest.approx(INIT + (PEAK - INIT) * s / 5)
    for s in range(5, 21):
        r = (s - 5) / 15
        assert lrs[s] == pytest.approx(MIN + (PEAK - MIN) * 0.5 * (1 + math.cos(math.pi * r)))
    assert lrs[21:] == pytest.approx([MIN] * 4)


def test_linear_and_constant():
    lin = trace(12, warmup_steps=2, decay_steps=10, decay_style="linear", min_lr=MIN)
    assert lin[0] == 0.0 and lin[1] == pytest.approx(0.5)
    assert lin[6] == pytest.approx(MIN + (PEAK - MIN) * (1 - 4 / 8))
    assert lin[10] == pytest.approx(MIN) and lin[11] == pytest.approx(MIN)
    assert trace(5, decay_style="constant") == pytest.approx([PEAK] * 5)


def test_inverse_square_root():
    lrs = trace(30, warmup_steps=4, decay_style="inverse-square-root", min_lr=0.3)
    assert lrs[4] == pytest.approx(PEAK)
    assert lrs[9] == pytest.approx(PEAK * math.sqrt(4 / 9))
    assert lrs[29] == pytest.approx(max(0.3, PEAK * math.sqrt(4 / 29)))
    assert min(lrs[5:]) >= 0.3


@pytest.mark.parametrize(
    "style,coeff",
    [
        ("linear", lambda r: 1 - r),
        ("cosine", lambda r: 0.5 * (1 + math.cos(math.pi * r))),
        ("exponential", lambda r: 2 * 0.5**r - 1),
    ],
)
def test_wsd(style, coeff):
    lrs = trace(
        22,
        warmup_steps=2,
        decay_steps=20,
        decay_style="WSD",
        wsd_decay_steps=8,
        wsd_decay_style=style,
        min_lr=MIN,
    )
    assert lrs[2:13] == pytest.approx([PEAK] * 11)  # stable until 20 - 8
    for s in range(13, 21):
        assert lrs[s] == pytest.approx(MIN + (PEAK - MIN) * coeff((s - 12) / 8))
    assert lrs[20] == pytest.approx(MIN)


def test_groups_keep_their_ratio_and_state_round_trips():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.1}])
    sched = build_lr_scheduler(opt, warmup_steps=2, decay_steps=10, decay_style="linear")
    for _ in range(4):
        opt.step()
        sched.step()
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs[1] == pytest.approx(lrs[0] * 0.1)
    opt2 = torch.optim.SGD([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.1}])
    sched2 = build_lr_scheduler(opt2, warmup_steps=2, decay_steps=10, decay_style="linear")
    sched2.load_state_dict(sched.state_dict())
    opt.step(), sched.step(), opt2.step(), sched2.step()
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(decay_style="bogus"), "lr.decay_style"),
        (dict(decay_style="cosine"), "lr.decay_steps"),
        (dict(decay_style="linear", warmup_steps=10, decay_steps=5), "lr.decay_steps"),
        (dict(decay_style="WSD", decay_steps=10), "lr.wsd_decay_steps"),
        (
            dict(decay_style="WSD", decay_steps=10, wsd_decay_steps=3, wsd_decay_style="step"),
            "lr.wsd_decay_style",
        ),
        (dict(decay_style="constant", min_lr=2.0), "lr.min_lr"),
        (dict(decay_style="constant", warmup_steps=-1), "lr.warmup_steps"),
    ],
)
def test_bad_schedules_name_the_field(kwargs, field):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    with pytest.raises(ConfigError) as info:
        build_lr_scheduler(opt, **kwargs)
    assert info.value.field == field
