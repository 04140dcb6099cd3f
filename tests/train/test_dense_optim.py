"""``CapturableAdagrad`` (the dense Adagrad of ``train.pipeline: graph``) is torch's Adagrad:
the same parameters and state bit for bit, step after step, and checkpoints move between the
two both ways."""

import copy

import pytest
import torch

from fbtriton_dist.train.dense_optim import CapturableAdagrad


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


def _train(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 5, generator=g)
        y = torch.rand(8, 1, generator=g)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("wd, eps", [(0.0, 1e-10), (0.01, 1e-6)], ids=["plain", "decay"])
def test_capturable_adagrad_is_torchs_adagrad(wd, eps):
    ours, theirs = _model(), _model()
    opt_a = CapturableAdagrad(ours.parameters(), lr=0.05, weight_decay=wd, eps=eps)
    opt_b = torch.optim.Adagrad(theirs.parameters(), lr=0.05, weight_decay=wd, eps=eps)
    _train(ours, opt_a, 6)
    _train(theirs, opt_b, 6)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt_a.state[a]["sum"], opt_b.state[b]["sum"])
        assert float(opt_a.state[a]["step"]) == float(opt_b.state[b]["step"]) == 6
    assert set(opt_a.param_groups[0]) >= set(opt_b.param_groups[0]) - {"params"}


def test_checkpoints_move_between_torchs_adagrad_and_the_capturable_one():
    base, other = _model(), _model()
    opt_torch = torch.optim.Adagrad(base.parameters(), lr=0.1)
    _train(base, opt_torch, 3)
    other.load_state_dict(base.state_dict())
    opt_ours = CapturableAdagrad(other.parameters(), lr=0.1)
    # torch's host step count comes in (a copy: on the CPU load_state_dict shares tensors)
    opt_ours.load_state_dict(copy.deepcopy(opt_torch.state_dict()))
    _train(base, opt_torch, 3, seed=2)
    _train(other, opt_ours, 3, seed=2)
    for a, b in zip(base.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b) and float(opt_ours.state[b]["step"]) == 6
    back = torch.optim.Adagrad(_model().parameters(), lr=0.1)
    back.load_state_dict(copy.deepcopy(opt_ours.state_dict()))  # and goes back
    assert all(float(s["step"]) == 6 for s in back.state.values())


def test_capturable_adagrad_refuses_what_it_does_not_do():
    opt = CapturableAdagrad(_model().parameters(), lr=0.1)
    opt.param_groups[0]["lr_decay"] = 0.1
    with pytest.raises(ValueError, match="lr_decay 0"):
        _train(_model(), opt, 1)
    with pytest.raises(ValueError, match="expected lr, weight_decay, eps >= 0"):
        CapturableAdagrad(_model().parameters(), lr=-1.0)
