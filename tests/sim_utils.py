"""Pieces of the single-process simulations that more than one test file replays."""

import torch

from titan_commopt.compress.dct import Chunker
from titan_commopt.compress.replicators import make_replicator


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


# ---- DeMo / FlexDeMo, one replica's shard (tests/test_demo.py, tests/test_tp.py) -----------------------
def phi(u, rule):
    """DeMo's φ: the sign of the update, or the update itself."""
    return u.sign() if rule == "sign" else u


def demo_extract(cfg, x, t, name, st):
    """What one replica sends (a dense picture of it) and its momentum subtraction."""
    lam = cfg.momentum_subtraction if cfg.base == "sgd" else 0.0
    numel = x.numel()
    sgn = (lambda v: v.sign()) if cfg.sign_before_sync else (lambda v: v)
    if cfg.replicator == "demo":
        c = Chunker(x.shape, cfg.chunk)
        coeffs = c.encode(x)
        idx = coeffs.abs().argsort(dim=-1, descending=True)[:, : min(cfg.topk, c.L)]
        kept = torch.zeros_like(coeffs).scatter_(-1, idx, coeffs.gather(-1, idx))
        st["m"] = st["m"] - lam * c.decode(kept)
        mask = torch.zeros_like(coeffs).scatter_(-1, idx, 1.0)
        return ("coeffs", sgn(kept), mask, c)
    if cfg.replicator in ("random", "striding"):
        stride = round(1 / cfg.compression_rate)
        if cfg.replicator == "random":
            idx = make_replicator(cfg, x.shape, name).indices(t, "cpu")
        else:
            idx = torch.arange(t % stride, numel, stride)  # every entry once per stride steps
        q = torch.zeros(numel)
        q[idx] = x.reshape(-1)[idx]
        q = q.view_as(x)
    else:
        period = round(1 / cfg.compression_rate) if cfg.replicator == "diloco" else 1
        if t % period:
            return None
        q = x.clone()
    st["m"] = st["m"] - lam * q
    return ("dense", sgn(q), None, None)


def demo_aggregate(cfg, sent, shape, t, name):
    """The replicas' mean of what :func:`demo_extract` gave, decoded to the shard's shape (``None`` when
    nothing was sent)."""
    if sent[0] is None:
        return None
    if sent[0][0] == "dense":
        return sum(s[1] for s in sent) / len(sent)
    c = sent[0][3]
    total = sum(s[1] for s in sent)
    if cfg.aggregate == "mean_selected":
        total = total / sum(s[2] for s in sent).clamp_min(1)
    else:
        total = total / len(sent)
    return c.decode(total)
