"""The held-out loss of the global model, on both torchtitan lines: what torchtitan's own validator
(``[validation]`` on 0.2.2, ``validator`` on 0.3) evaluates when titan_commopt trains.

Each line's validator (``tt022/validate.py``, ``tt03/validate.py``) is torchtitan's ``Validator``
with its ``validate()`` (the loop, its PP and CP paths, the loss and the ``validate step:`` line)
run unchanged inside :func:`global_model_of`, which the optimizer container provides
(``CommOptimizersContainer.global_model``):

- per-step families (DeMo, FlexDeMo, Dion) and torchtitan's AdamW/Adam: the parameters, equal on every
  replica after each step;
- DiLoCo and SparseLoCo: the anchor, x after the last outer step that landed;
- DES-LOC, MT-DAO, Local Adam: at a sync boundary the parameters, between syncs mean_R(x) (what a sync
  now would make);

checked equal across replicas by fingerprint before the first batch, and each replica's own
parameters put back bit for bit afterwards: training goes on as if nothing was evaluated. Every
evaluation reads the same held-out batches from the start of the held-out set (0.3's validator
builds its dataloader at each ``validate()``; 0.2.2's is rebuilt likewise), so losses compare across
steps and runs.

The container reaches the validator through the metrics processor, whose ``optimizers`` both lines'
Trainers set before they build the validator.
"""

from contextlib import nullcontext
from typing import Any, ContextManager

from .container import CommOptimizersContainer

__all__ = ["global_model_of"]


def global_model_of(metrics_processor: Any) -> ContextManager[None]:
    """The context in which the run's model is the global model (:mod:`validation`): our
    container's ``global_model()``, or nothing to do for torchtitan's own container (HSDP keeps the
    replicas equal)."""
    container = getattr(metrics_processor, "optimizers", None)
    if container is None:
        raise RuntimeError("validation before the Trainer set metrics_processor.optimizers: the validator cannot "
                           "find the optimizer container whose global model it evaluates")
    if isinstance(container, CommOptimizersContainer):
        return container.global_model()
    return nullcontext()
