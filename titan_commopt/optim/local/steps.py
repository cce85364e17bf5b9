"""What the local-step families share (the local-adaptive family, SparseLoCo): every replica steps on
its own gradient and syncs R every few steps.

- :func:`trainable`: the parameters they step (frozen ones left out);
- :class:`LocalSteps`, mixed in before ``CommOptimizer``: the step counter, the step prologue
  (:meth:`LocalSteps.begin_local_step`: closure, counter, each parameter's row of tensors by param
  group), the metrics, and a checkpoint that holds no sync in flight;
- :func:`column_chunks`: a param group's rows cut into chunks for the multi-tensor updates
  (``optim/updates.py``), their size bounded by :func:`chunk_limit`.
"""

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from ..common import local, replica_grad

__all__ = ["LocalSteps", "LocalStep", "trainable", "chunk_limit", "column_chunks", "CHUNK_ELEMENTS",
           "DEFAULT_CHUNK_ELEMENTS"]

# Elements per multi-tensor update call, by device type. On a GPU it bounds the temporaries a call
# allocates for its whole list; on a CPU (where the foreach ops loop over the tensors anyway) a small
# chunk keeps every operation of the update on data still in cache, and the temporaries small enough
# for the allocator to reuse (the measurement behind 2^16: docs/benchmarks.md §3).
CHUNK_ELEMENTS = {"cpu": 1 << 16}
DEFAULT_CHUNK_ELEMENTS = 1 << 24

Row = list[torch.Tensor]  # one parameter's tensors: x, g (in x's dtype), then its states


def trainable(named_params: Any) -> list:
    """``(fqn, param)`` pairs, or param-group dicts of them, without the frozen parameters."""
    items = list(named_params)
    if items and isinstance(items[0], dict):
        return [{**g, "params": [(n, p) for n, p in g["params"] if p.requires_grad]} for g in items]
    return [(n, p) for n, p in items if p.requires_grad]


def chunk_limit(device: torch.device) -> int:
    """Elements per multi-tensor update call on ``device``."""
    return CHUNK_ELEMENTS.get(device.type, DEFAULT_CHUNK_ELEMENTS)


def column_chunks(rows: list[Row], limit: float) -> Iterator[list[list[torch.Tensor]]]:
    """``rows`` packed into chunks of at most ``limit`` elements (a larger parameter is a chunk of its
    own), each chunk given as its columns (all x, all g, then each state's)."""
    chunk: list[Row] = []
    total = 0
    for row in rows:
        size = row[0].numel()
        if chunk and total + size > limit:
            yield [list(col) for col in zip(*chunk)]
            chunk, total = [], 0
        chunk.append(row)
        total += size
    if chunk:
        yield [list(col) for col in zip(*chunk)]


@dataclass
class LocalStep:
    """One local step's work: ``n`` the update number (1-based: what bias corrections count);
    ``clock`` the step number (1-based: what the sync schedule counts, skipped steps included);
    ``grads`` each parameter with a gradient and this replica's gradient of it
    (``common.replica_grad``, before any dtype cast); ``groups`` per param group its rows
    (:data:`Row`), in the order of ``param_groups``."""

    n: int
    clock: int
    grads: list[tuple[torch.Tensor, torch.Tensor]]
    groups: list[tuple[dict, list[Row]]]


class LocalSteps:
    """Mixed in before ``CommOptimizer`` by the local-step families:

    - one update counter for every parameter: ``self._n`` (a Python int, no host read) and
      ``self._step_t``, the CPU scalar tensor every ``state["step"]`` is, so checkpoints carry it;
    - the clock ``self._clock``, the steps taken: updates and the steps skipped for a NaN/Inf gradient
      (:meth:`skip_update`), so that a skipped step keeps the sync schedule, as a GradScaler-skipped inner
      step keeps Templar's; the syncs count it, the update formulas count ``_n``. A checkpoint holds
      ``_n``; the container, whose saved step count the clock equals, sets it back (:meth:`set_clock`);
    - :meth:`begin_local_step`, the start of every ``step()``; :meth:`skip_update`, a step without one;
    - ``metrics()``: the syncs in flight on ``runtime`` and the steps to the next sync;
    - ``step_attributes``: the counter and its tensor, kept by ``CommOptimizer.snapshot()`` (the
      tensor is every state's ``step``, but a replica with no trainable shard has no state);
    - ``state_dict()`` lands every sync in flight first (waiting for its collective): a checkpoint
      holds no half-done sync, and the run that saved continues from the same state as a run resumed
      from it (a streaming sync then lands up to ``sync_delay`` − 1 steps early, at the checkpoint's
      step: the one thing a checkpoint changes in the trajectory; an overlapped outer step, ``merge =
      "delayed"`` / ``"eager"``, only completes its collective, whose result is state, and changes
      nothing); under live fault tolerance it fails them instead (``CommOptimizer._settle_for_save``:
      landing them would be an R collective after a step's commit; the container lands them inside the
      step before a checkpoint, so a checkpoint finds none); ``load_state_dict()`` drops the
      syncs in flight (the state they belong to is replaced) and reads the counter back once.
    """

    _n: int
    _clock: int
    _step_t: torch.Tensor
    step_attributes = ("_n", "_clock", "_step_t")

    def start_step_counter(self) -> None:
        """No update yet: the counter and the clock at 0, and the tensor every ``state["step"]`` will be."""
        self._n = self._clock = 0
        self._step_t = torch.tensor(0.0)

    def set_clock(self, steps: int) -> None:
        """The clock after a load: ``steps`` taken so far (the container's saved count; updates and
        skipped steps). ``load_state_dict`` alone sets it to the updates, right where no step was skipped."""
        self._clock = steps

    def _sync(self, clock: int) -> None:
        """The family's R syncs due after step ``clock`` (issued, landed, merged); none here (Muon's family
        averages inside its update)."""

    @torch.no_grad()
    def skip_update(self) -> None:
        """A step skipped for a NaN/Inf gradient: no update (the gradient is not read), but the clock
        moves and the syncs due after this step run as after an update (the other replicas, which may
        have stepped, sync now too). Nothing moves where ``step()`` would not: no parameter has a gradient."""
        if not any(p.grad is not None for group in self.param_groups for p in group["params"]):
            return
        self._clock += 1
        self._sync(self._clock)

    def begin_local_step(
        self, closure: Optional[Callable[[], Any]], row_states: Callable[[dict], list[str]]
    ) -> tuple[Any, Optional[LocalStep]]:
        """The closure's loss and this step's :class:`LocalStep` (``None`` when no parameter has a
        gradient: then nothing moves, the counter included). ``row_states(group)``: the state keys
        whose local tensors follow x and g in each row of that param group."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(group, p, replica_grad(p, self.topology, ledger=self.ledger))
                for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not work:
            return loss, None
        self._n += 1
        self._clock += 1
        self._step_t.fill_(self._n)
        by_group: dict[int, tuple[dict, list[Row]]] = {}
        for group, p, g in work:
            x, state = local(p), self.state[p]
            row = [x, g if g.dtype == x.dtype else g.to(x.dtype)] + [local(state[key]) for key in row_states(group)]
            by_group.setdefault(id(group), (group, []))[1].append(row)
        return loss, LocalStep(self._n, self._clock, [(p, g) for _, p, g in work], list(by_group.values()))

    def metrics(self) -> dict[str, float]:
        out = {"syncs_in_flight": float(self.runtime.in_flight)}
        steps = self.steps_to_next_sync()
        if steps is not None:
            out["steps_to_next_sync"] = float(steps)
        return out

    def state_dict(self) -> dict[str, Any]:
        self._settle_for_save()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.runtime.abandon()
        super().load_state_dict(state_dict)
        # a checkpoint of per-parameter counters: their largest, then one shared tensor again
        steps = [s["step"] for s in self.state.values() if "step" in s]
        self._n = self._clock = int(max(float(t) for t in steps)) if steps else 0
        self._step_t = torch.tensor(float(self._n))
        for s in self.state.values():
            if "step" in s:
                s["step"] = self._step_t
