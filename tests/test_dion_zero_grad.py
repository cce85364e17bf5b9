"""Dion with a gradient that is exactly zero: the matrix changes by weight decay only (microsoft/dion's
rule). Without it the Gram of an all-zero P falls back to a QR of zeros (identity columns) and the
unnormalized initial Q is applied: an 8×6 matrix at lr 0.02, rank 2 moves further at every step.
The distributed case (a zero gradient on every rank of a TP-sharded run) is in ``tests/test_tp.py``
(``Dion/zero_w1``)."""

import pytest
import torch
from torch import nn

from titan_commopt.optim import make
from titan_commopt.optim.common import BaseHParams
from titan_commopt.topology import Topology


@pytest.mark.parametrize("orthogonalize", ["cholesky_qr", "qr"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_all_zero_gradient_moves_by_weight_decay_only(orthogonalize, wd):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(8, 6, dtype=torch.float64))
    expected = p.detach().clone()
    lr = 0.02
    opt = make("Dion", [("layers.0.attention.wo.weight", p)], Topology.single(),
               BaseHParams(lr=lr, weight_decay=wd), rank=2, orthogonalize=orthogonalize)
    for _ in range(3):
        p.grad = torch.zeros_like(p)
        opt.step()
        expected.mul_(1 - opt.param_groups[0]["lr"] * wd)  # lr × the preset's lr_scale
        assert torch.equal(p.detach(), expected)
    assert torch.equal(opt.state[p]["momentum"], torch.zeros_like(p))  # nothing fed back either
    # the all-zero P has a singular Gram: CholeskyQR2 fell back at every step (QR needs no fallback)
    assert opt.metrics() == {"orthonormalize_fallbacks": 3.0 if orthogonalize == "cholesky_qr" else 0.0}


def test_training_resumes_normally_after_zero_gradients():
    """After zero-gradient steps, a real gradient gives the same update as a fresh optimizer would on
    the decayed matrix with the same (initial) Q: the masked steps leave no trace in M or Q."""
    torch.manual_seed(1)
    X0 = torch.randn(8, 6, dtype=torch.float64)
    G = torch.randn(8, 6, dtype=torch.float64)
    hp = BaseHParams(lr=0.02, weight_decay=0.0)
    p = nn.Parameter(X0.clone())
    opt = make("Dion", [("w.weight", p)], Topology.single(), hp, rank=2)
    for _ in range(2):
        p.grad = torch.zeros_like(p)
        opt.step()
    p.grad = G.clone()
    opt.step()
    q = nn.Parameter(X0.clone())
    fresh = make("Dion", [("w.weight", q)], Topology.single(), hp, rank=2)
    q.grad = G.clone()
    fresh.step()
    assert torch.equal(p.detach(), q.detach())
    assert (p.detach() - X0).abs().max() > 1e-3
