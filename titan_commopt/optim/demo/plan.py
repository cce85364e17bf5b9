"""DeMo's per-step work over R, laid out once per set of parameters with gradients: a :class:`Plan`.

The optimizer (``optimizer.py``) drives one step's exchange as a task of its runtime
(``titan_commopt.overlap``): :meth:`Plan.pack` runs the base step, extracts and writes every
shard's payload into one fused ``uint8`` send buffer; the task all-gathers it over R;
:meth:`Plan.apply` decodes every replica's bytes and applies eq. 7. What the plan needs of its
optimizer — the base step, φ, the gradients, the step counts, the state — is handed to it (a
:class:`Rules` value chosen at construction, and arguments), so it calls nothing of the optimizer.

DeMo replicator: shards are grouped by (local shape, device, β, λ) — each group one transform, one
top-k, one packing. The send buffer holds every group's values first, then every group's indices
(float values stay aligned, and each shard's segment sizes are exactly its ``payload_bytes``).
Other replicators (random, striding, diloco, full) work on each flat shard in turn.

With :class:`Fused` (``[commopt] kernels`` chose Triton) a DeMo group's transform, momentum, top-k and
eq. 8 run in one kernel pass per chunk (``plan_triton.encode``) and its received pairs, the
inverse, φ and eq. 7 in another (``plan_triton.decode``); the wire bytes are written and read by
the kernels of ``compress/packing_triton.py`` where they can, by the codecs elsewhere.
"""

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from titan_commopt.compress.dct import Chunker
from titan_commopt.compress.replicators import DeMoReplicator, Replicator

from .. import updates
from ..common import local

__all__ = ["Phi", "Rules", "Fused", "Plan", "descend_shard", "GROUP_NUMEL"]

GROUP_NUMEL = 1 << 24  # elements per DeMo batch at most: bounds the three scratch buffers (64 MiB each)

# (state, param group, g, t) → x, the signal the replicator extracts from (see ``demo.BASES``)
Direction = Callable[[dict, dict, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class Phi:
    """φ of eq. 7. ``shard``: on one shard's update (may return its argument); ``batch_``: the same,
    in place, on a batch of shards — only for an elementwise φ (``None``: φ needs each shard's own
    matrix, as Muon does)."""

    shard: Callable[[torch.Tensor], torch.Tensor]
    batch_: Optional[Callable[[torch.Tensor], Any]] = None


@dataclass(frozen=True)
class Rules:
    """The algorithm a plan carries out, fixed by the options: the base step, whether eq. 8
    subtracts the transmitted part from it (the base's direction is its momentum), and φ."""

    direction: Direction
    subtract: bool
    phi: Phi


@dataclass(frozen=True)
class Fused:
    """The DCT replicator's Triton kernels, chosen once by the optimizer: ``kernels`` is the module
    ``titan_commopt.optim.demo.plan_triton`` (imported only when Triton runs); ``sign``: φ is sign (``True``),
    identity (``False``) or not elementwise (``None``, Muon: the receiving side stays on torch);
    ``precision``: of the kernels' products (``demo_dct.PRECISIONS``)."""

    triton: Any
    sign: Optional[bool]
    precision: str = "ieee"


def descend_shard(p: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float,
                  blocks: Optional[Chunker] = None) -> None:
    """Eq. 7 on ``p``'s shard with ``update`` = φ(Q); ``blocks``: ``update`` is in that chunker's
    block layout (a view), and so is the shard it is applied to."""
    x = local(p)
    if blocks is not None:
        if x.is_contiguous():
            x = blocks.blocks(x)
        else:
            update = update.reshape(x.shape)
    updates.descend_(x, update.to(x.dtype), lr, weight_decay)  # eq. 7


class _Group:
    """Same-shape shards of the DeMo replicator, transformed, selected and packed as one batch."""

    def __init__(self, members: list, rep: DeMoReplicator, coefficient_domain: bool, device,
                 fused: Optional["Fused"]):
        self.members, self.rep = members, rep  # members: [(p, param group, state)]
        self.G = len(members)
        self.rows = self.G * rep.chunker.n_chunks
        self.numel = self.G * rep.chunker.numel
        self.momentum = (torch.zeros(self.rows, rep.chunker.L, device=device) if coefficient_domain else None)
        # the encode kernels' selection, then packed into the send buffer by the wire kernel
        # (``compress/packing_triton.py``) or, where it cannot, by the codecs
        self.wire = fused.triton.wire_of(rep, device) if fused is not None else None
        self.selection = ((torch.empty(self.rows, rep.k, device=device),
                           torch.empty(self.rows, rep.k, dtype=torch.int64, device=device)) if fused is not None else None)
        self.device = device
        self.value_offset = self.index_offset = 0


@dataclass
class Sent:
    """What one step packed, for :meth:`Plan.apply`: per DeMo group its members with the step's
    (lr, weight decay), per flat-replicator shard its segment of the buffer."""

    groups: list
    flats: list


class Plan:
    """The per-step work of the parameters ``active`` (``(p, param group)`` pairs with gradients).

    ``state``: the optimizer's per-parameter state (every active parameter's already initialized:
    the plan adds the DeMo-SGD momentum rows of the coefficient domain); ``replicator``: the
    replicator of a parameter's local shard; ``coefficient_domain``: DeMo-SGD keeps its momentum as
    DCT coefficients (``demo.DeMo``'s docstring); ``demo``: the replicator is DeMo's (DCT top-k,
    batched by shape), else a flat one; ``fused``: the DCT replicator's Triton kernels (``None``: torch)."""

    def __init__(self, active: list, state: Mapping[torch.Tensor, dict], replicator: Callable[[torch.Tensor], Replicator],
                 coefficient_domain: bool, demo: bool, fused: Optional[Fused] = None):
        self.key = self.key_of(active)
        self.demo = demo
        self.fused = fused if demo else None
        self.groups: list[_Group] = []
        self.flats: list = []  # (p, param group, state, replicator)
        for p, _ in active:
            if not local(p).numel() and coefficient_domain:
                state[p]["momentum"] = torch.zeros(0, device=local(p).device)
        live = [(p, group) for p, group in active if local(p).numel()]
        if not demo:
            self.flats = [(p, group, state[p], replicator(p)) for p, group in live]
            return
        buckets: dict[tuple, list] = {}
        for p, group in live:
            x = local(p)
            buckets.setdefault((tuple(x.shape), x.device, group["beta"], group["lam"]), []).append((p, group, state[p]))
        for (shape, device, _, _), members in buckets.items():
            per = max(1, GROUP_NUMEL // max(1, math.prod(shape)))
            for start in range(0, len(members), per):
                part = members[start: start + per]
                self.groups.append(_Group(part, replicator(part[0][0]), coefficient_domain, device, self.fused))
        offset = 0
        for grp in self.groups:
            grp.value_offset, offset = offset, offset + grp.G * grp.rep.value_bytes
        for grp in self.groups:
            grp.index_offset, offset = offset, offset + grp.G * grp.rep.index_bytes
        self.send_bytes = offset
        biggest = max((grp.numel for grp in self.groups), default=0)
        self.scratch = {d: [torch.empty(biggest, device=d) for _ in range(3)] for d in {grp.device for grp in self.groups}}
        for grp in self.groups:
            if grp.momentum is None:
                continue
            n = grp.rep.chunker.n_chunks
            for i, (_, _, st) in enumerate(grp.members):
                rows = grp.momentum[i * n: (i + 1) * n]
                old = st.get("momentum")
                if old is not None and old.numel():
                    rows.copy_(old.reshape(rows.shape))
                st["momentum"] = rows  # a view: the state is the group buffer's rows (coefficients)

    @staticmethod
    def key_of(active: list) -> tuple:
        """What a plan is made for: its parameters and their param groups (a plan reads a group's lr
        and weight decay at every step, so a group replaced, as a load does, needs a new plan)."""
        return tuple((id(p), id(group)) for p, group in active)

    def hand_over(self, successor: "Plan") -> None:
        """``successor`` replaces this plan (the set of parameters with gradients changed): a shard
        that is not its member keeps its coefficient-domain momentum as a copy of its rows, so this
        plan's buffers are freed instead of held by the rows of the shards left out."""
        staying = {pid for pid, _ in successor.key}
        for grp in self.groups:
            if grp.momentum is not None:
                for p, _, st in grp.members:
                    if id(p) not in staying:
                        st["momentum"] = st["momentum"].clone()

    # ---- send -------------------------------------------------------------------------------------
    def pack(self, rules: Rules, grad: Callable[[torch.Tensor], torch.Tensor],
             steps: Mapping[int, int]) -> tuple[Optional[torch.Tensor], Sent]:
        """The base step of every shard, eq. 8, and the fused send buffer (``None`` when nothing is
        sent this step). ``grad``: a parameter's float32 replica gradient; ``steps``: its step count
        (by ``id``), this step's."""
        return self._pack_demo(rules, grad, steps) if self.demo else self._pack_flat(rules, grad, steps)

    def _pack_demo(self, rules: Rules, grad, steps) -> tuple[Optional[torch.Tensor], Sent]:
        if not self.groups:
            return None, Sent([], [])
        device, words = self.groups[0].device, None
        if self.fused is not None:  # the kernels OR their bits into zeroed 32-bit words
            words = torch.zeros(self.fused.triton.words_for(self.send_bytes), dtype=torch.int32, device=device)
            send = words.view(torch.uint8)[: self.send_bytes]
        else:
            send = torch.empty(self.send_bytes, dtype=torch.uint8, device=device)
        groups = []
        for grp in self.groups:
            rep, ch = grp.rep, grp.rep.chunker
            tmp, out, work = self.scratch[grp.device]
            members = [(p, group["lr"], group["weight_decay"]) for p, group, _ in grp.members]
            if self.fused is not None:
                selection = self._encode_fused(grp, rules, grad, steps, words)
                if selection is None:  # the wire bytes are written
                    groups.append(members)
                    continue
                vals, idx = selection
            elif grp.momentum is not None:  # DeMo-SGD: eq. 2 in the coefficient domain, m_dct ← β·m_dct + DCT(g)
                coeffs = ch.blocks_to_chunk_major(ch.forward([grad(p) for p, _, _ in grp.members], out=out, tmp=tmp))
                beta, lam = grp.members[0][1]["beta"], grp.members[0][1]["lam"]
                m = grp.momentum
                torch.add(coeffs, m.view(coeffs.shape), alpha=beta, out=m.view(coeffs.shape))
                vals, idx = rep.select(m, work=tmp)
                if lam:
                    m.scatter_add_(-1, idx, vals * -lam)  # eq. 8 (indices are distinct within a chunk)
            else:  # the base's direction in the parameter domain (decoupled AdamW), transformed
                xs = [rules.direction(st, group, grad(p), steps[id(p)]) for p, group, st in grp.members]
                coeffs = ch.blocks_to_chunk_major(ch.forward(xs, out=out, tmp=tmp))
                dense = work[: grp.numel].view(coeffs.shape)
                dense.copy_(coeffs)
                vals, idx = rep.select(dense.view(grp.rows, ch.L), work=tmp)
            rep.write(vals, idx, send[grp.value_offset: grp.value_offset + grp.G * rep.value_bytes].view(grp.G, -1),
                      send[grp.index_offset: grp.index_offset + grp.G * rep.index_bytes].view(grp.G, -1))
            groups.append(members)
        return send, Sent(groups, [])

    def _encode_fused(self, grp: _Group, rules: Rules, grad, steps,
                      words: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The torch branches of :meth:`_pack_demo` in one kernel pass per chunk (eq. 2, top-k, eq. 8,
        and the wire bytes into ``words``, the send buffer). Returns ``None``, or the selection where
        the kernel cannot write this group's wire (``packing_triton.wire_of``) and the codecs pack it."""
        where = dict(wire=grp.wire, words=words, value_byte=grp.value_offset, index_byte=grp.index_offset)
        if grp.momentum is not None:
            xs = [grad(p).contiguous() for p, _, _ in grp.members]
            group = grp.members[0][1]
            self.fused.triton.encode(grp.rep.chunker, xs, grp.rep.k, *grp.selection, momentum=grp.momentum,
                                      beta=group["beta"], lam=group["lam"], precision=self.fused.precision, **where)
        else:
            xs = [rules.direction(st, group, grad(p), steps[id(p)]).contiguous() for p, group, st in grp.members]
            self.fused.triton.encode(grp.rep.chunker, xs, grp.rep.k, *grp.selection, precision=self.fused.precision,
                                      **where)
        return grp.selection if grp.wire is None else None

    def _pack_flat(self, rules: Rules, grad, steps) -> tuple[Optional[torch.Tensor], Sent]:
        sizes = [rep.payload_bytes(steps[id(p)]) for p, _, _, rep in self.flats]  # shapes and step only
        send = torch.empty(sum(sizes), dtype=torch.uint8, device=local(self.flats[0][0]).device) if sum(sizes) else None
        flats, offset = [], 0
        for (p, group, st, rep), n in zip(self.flats, sizes):
            t = steps[id(p)]
            x = rules.direction(st, group, grad(p), t)  # eq. 2: x is the momentum itself (or Adam's direction)
            if not n:
                continue
            q, _ = rep.extract(x, t, out=send[offset: offset + n])
            if rules.subtract:
                x.sub_(q, alpha=group["lam"])  # eq. 8
            flats.append((p, rep, t, offset, n, group["lr"], group["weight_decay"]))
            offset += n
        return send, Sent([], flats)

    # ---- receive ------------------------------------------------------------------------------------
    def apply(self, payloads: torch.Tensor, sent: Sent, phi: Phi) -> None:
        """Every replica's bytes (``[W, bytes]``, own included) → the mean (eq. 5–6) → eq. 7 on every
        shard, with the lr and weight decay of the step that packed them."""
        W = payloads.shape[0]
        for grp, members in zip(self.groups, sent.groups):
            rep, ch = grp.rep, grp.rep.chunker
            tmp, out, work = self.scratch[grp.device]
            values = payloads[:, grp.value_offset: grp.value_offset + grp.G * rep.value_bytes].view(W, grp.G, -1)
            indices = payloads[:, grp.index_offset: grp.index_offset + grp.G * rep.index_bytes].view(W, grp.G, -1)
            if self._decode_fused(grp, members, payloads, values, indices):
                continue
            dense = rep.mean_coefficients(values, indices, out=work)  # eq. 6, chunk-major
            Q = ch.inverse(dense, out=out, tmp=tmp)  # (rows, L) chunk-major, parameter domain
            if phi.batch_ is not None:
                phi.batch_(Q)
            blocks = ch.chunk_major_to_blocks(Q.view(grp.G, -1))
            batched: dict[tuple, tuple[list, list]] = {}  # (lr, wd) -> shards and updates, block layout
            for i, (p, lr, wd) in enumerate(members):
                u, x = blocks[i], local(p)
                if phi.batch_ is None:
                    descend_shard(p, phi.shard(u.reshape(ch.shape)), lr, wd)
                elif x.is_contiguous() and x.dtype == u.dtype:
                    xs, us = batched.setdefault((lr, wd), ([], []))
                    xs.append(ch.blocks(x))
                    us.append(u)
                else:
                    descend_shard(p, u, lr, wd, blocks=ch)
            for (lr, wd), (xs, us) in batched.items():  # updates.descend_ on every shard, one call each
                if wd != 0:
                    torch._foreach_mul_(xs, 1 - lr * wd)
                torch._foreach_add_(xs, us, alpha=-lr)
        for p, rep, t, offset, n, lr, wd in sent.flats:
            descend_shard(p, phi.shard(rep.aggregate(payloads[:, offset: offset + n], t)), lr, wd)

    def _decode_fused(self, grp: _Group, members: list, payloads: torch.Tensor, values: torch.Tensor,
                      indices: torch.Tensor) -> bool:
        """The receiving side of one group in one kernel pass per chunk (every replica's bytes read
        in place where the kernel writes the group's wire, the sum over replicas in replica order,
        eq. 6, the inverse, φ, eq. 7), where the kernel can: φ elementwise and every shard contiguous.
        ``False``: the caller runs the torch path."""
        fused = self.fused
        if fused is None or fused.sign is None:
            return False
        shards = [local(p) for p, _, _ in members]
        if not all(x.is_contiguous() for x in shards):
            return False
        rep, (tmp, out, work) = grp.rep, self.scratch[grp.device]
        lrs, wds = [lr for _, lr, _ in members], [wd for _, _, wd in members]
        if grp.wire is not None:
            fused.triton.decode(rep.chunker, None, None, shards, lrs, wds, fused.sign, dense=work, count=tmp,
                                 precision=fused.precision, wire=grp.wire, payloads=payloads,
                                 value_byte=grp.value_offset, index_byte=grp.index_offset,
                                 mean_selected=rep.mean_selected)
            return True
        vals, idx, selected = rep.received(values, indices)
        fused.triton.decode(rep.chunker, vals, idx, shards, lrs, wds, fused.sign, selected=selected, dense=work,
                             count=tmp if selected is not None else None, precision=fused.precision)
        return True
