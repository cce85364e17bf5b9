"""torchtitan 0.2.2's ``[validation]`` for our TrainSpecs (``build_validator_fn``): torchtitan's
``Validator`` evaluating the global model (``common/validation.py``) on the same held-out batches at
every evaluation."""

from typing import Any

from torch import nn
from torchtitan.components.validate import Validator
from torchtitan.hf_datasets.text_datasets import build_text_validation_dataloader

from ..common.validation import global_model_of

__all__ = ["GlobalModelValidator"]


class GlobalModelValidator(Validator):
    """torchtitan 0.2.2's ``Validator``: its ``validate()`` inside the container's global model, on a
    dataloader made anew for each evaluation (torchtitan's keeps its position from one evaluation to
    the next, so each would read other batches; 0.3's validator makes it anew too). Built with
    torchtitan's ``build_validator_fn`` keyword arguments."""

    def __init__(self, *, dp_world_size: int, dp_rank: int, **kwargs: Any) -> None:
        super().__init__(dp_world_size=dp_world_size, dp_rank=dp_rank, **kwargs)
        self._dp_world_size, self._dp_rank = dp_world_size, dp_rank

    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        self.validation_dataloader = build_text_validation_dataloader(
            dp_world_size=self._dp_world_size, dp_rank=self._dp_rank, tokenizer=self.tokenizer,
            job_config=self.job_config, infinite=self.job_config.validation.steps != -1,
        )
        with global_model_of(self.metrics_processor):
            super().validate(model_parts, step)
