"""TrainSpec registration: importing ``titan_commopt.titan`` registers these model names.

- ``llama3_commopt``: torchtitan's llama3 with our ``build_optimizers_fn`` (``[optimizer] name`` picks
  AdamW or any registered titan_commopt optimizer), our parallelize wrapper (R left to optimizers
  that sync it themselves), the ``comm/*`` metrics, the offline tokenizer, and ``[validation]`` on the
  global model (``validate.py``).
- ``llama3_reference``: torchtitan's stock llama3 spec, changed only where a CPU run or the offline
  data needs it (tokenizer, extra flavors, SUM reduction on gloo), and a validator that reads the same
  held-out batches at every evaluation as ours does (so that the two compare): the baseline.

Both know llama3's flavors plus small ones for CPU, two mid sizes for comm reports and a 1B-class
one for a single GPU.
"""

import dataclasses
import functools
from typing import Any

from torchtitan.models.llama3 import TransformerModelArgs, llama3_args
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from ..common.data import register_datasets
from ..common.model import COMMOPT_SPEC, FLAVOR_SHAPES, REFERENCE_SPEC
from ..platform.cpu import force_sum_reduction, on_cpu
from . import tokenizer
from .build import build_optimizers
from .metrics import build_metrics_processor
from .parallelize import wrap_parallelize
from .run_context import CommoptRun
from .validate import GlobalModelValidator

EXTRA_FLAVORS = {
    name: TransformerModelArgs(**{**shape, "vocab_size": shape["vocab_size"] or tokenizer.VOCAB_SIZE})
    for name, shape in FLAVOR_SHAPES.items()
}


def _reference_parallelize(stock):
    def parallelize(model, parallel_dims, job_config):
        model = stock(model, parallel_dims, job_config)
        if on_cpu():
            force_sum_reduction(model)
        return model

    return parallelize


def bind_run(spec: TrainSpec, run: CommoptRun) -> TrainSpec:
    """``spec`` with ``run`` bound into its optimizer builder, when the builder is ours (a stock
    spec, e.g. ``llama3_reference``, is returned as it is). Under fault tolerance each replica group
    reads its own part of the data (``ReplicaGroupTraining.data_shard``)."""
    if spec.build_optimizers_fn is not build_optimizers:
        return spec
    changes: dict = {"build_optimizers_fn": functools.partial(build_optimizers, run=run)}
    ft = run.fault_tolerance
    if ft is not None and spec.build_dataloader_fn is not None:
        build_dataloader = spec.build_dataloader_fn

        def build_group_shard(*args: Any, dp_world_size: int, dp_rank: int, **kwargs: Any) -> Any:
            dp_world_size, dp_rank = ft.data_shard(dp_world_size, dp_rank)
            return build_dataloader(*args, dp_world_size=dp_world_size, dp_rank=dp_rank, **kwargs)

        changes["build_dataloader_fn"] = build_group_shard
    return dataclasses.replace(spec, **changes)


def register() -> None:
    from torchtitan.protocols import train_spec as registry

    if COMMOPT_SPEC in registry._extra_train_specs:
        return
    register_datasets()
    stock: TrainSpec = get_train_spec("llama3")
    flavors = {**llama3_args, **EXTRA_FLAVORS}
    register_train_spec(
        COMMOPT_SPEC,
        dataclasses.replace(
            stock,
            model_args=flavors,
            parallelize_fn=wrap_parallelize(stock.parallelize_fn),
            build_optimizers_fn=build_optimizers,
            build_tokenizer_fn=tokenizer.build_tokenizer,
            build_metrics_processor_fn=build_metrics_processor,
            build_validator_fn=GlobalModelValidator,
        ),
    )
    register_train_spec(
        REFERENCE_SPEC,
        dataclasses.replace(
            stock,
            model_args=flavors,
            parallelize_fn=_reference_parallelize(stock.parallelize_fn),
            build_tokenizer_fn=tokenizer.build_tokenizer,
            build_validator_fn=GlobalModelValidator,
        ),
    )
