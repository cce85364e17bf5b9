"""Pieces of the single-process simulations that more than one test file replays."""

import torch


@torch.no_grad()
def nesterov_outer_step_(models, anchors, bufs, mu: float, outer_lr: float) -> None:
    """DiLoCo's outer step, replayed by hand: ``models[0]`` holds mean_R(x) (the replicas were just
    averaged); Δ = anchor − mean, b ← μ·b + Δ, x ← anchor − η_out·(Δ + μ·b) on every replica, and
    the anchor becomes the new x."""
    for i, mean in enumerate(list(models[0].parameters())):
        delta = anchors[i] - mean
        bufs[i] = mu * bufs[i] + delta
        new = anchors[i] - outer_lr * (delta + mu * bufs[i])
        anchors[i] = new.clone()
        for m in models:
            list(m.parameters())[i].data.copy_(new)
