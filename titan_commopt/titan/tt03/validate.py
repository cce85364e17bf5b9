"""torchtitan 0.3's validator for our configs: torchtitan's ``Validator`` evaluating the global model
(``common/validation.py``). 0.3's validator builds its dataloader at every ``validate()``, so every
evaluation reads the same held-out batches already.

Where it comes in: our config module's configs (``configs.py``), our TOML runner's ``[validation]``
(``tt03_toml/toml_config.py``), and any config through ``--override.imports
titan_commopt.titan.tt03.overrides.global_model_validation`` (``overrides.py``). Its settings are
checked as it is made (tyro makes it from the command line before any process group exists), one line
each, exit status 2 (:func:`validator_problems`; the pre-flight checks run the same on any validator
config of a run: ``preflight.py``).
"""

from dataclasses import dataclass, fields
from typing import Any

from torch import nn
from torchtitan.components.validate import Validator

from titan_commopt.options import ConfigError

from ..common.validation import global_model_of
from .container import refuse

__all__ = ["GlobalModelValidator", "validator_problems", "validating_on_training_text", "with_global_model_validation"]


def validator_problems(config: Any) -> list[str]:
    """Bad settings of an enabled validator config, one line each: ``freq`` and ``steps`` below 1
    (``steps = -1``, the whole held-out set, may hang: the ranks' shards end at different batches)."""
    if not getattr(config, "enable", False):
        return []
    out = []
    if not (isinstance(config.freq, int) and config.freq >= 1):
        out.append(f"--validator.freq {config.freq}: allowed is an integer >= 1")
    steps = getattr(config, "steps", 1)
    if not (isinstance(steps, int) and steps >= 1):
        out.append(f"--validator.steps {steps}: allowed is an integer >= 1 (batches per evaluation; -1, the whole "
                   "held-out set, is refused: the ranks' shards of it end at different batches, which torchtitan "
                   "warns may hang the evaluation)")
    return out


def validating_on_training_text(config: Any) -> list[str]:
    """One line when an enabled validator reads the training dataset itself: not held-out text."""
    validator, training = getattr(config, "validator", None), getattr(config, "dataloader", None)
    if not getattr(validator, "enable", False) or training is None:
        return []
    data = lambda loader: (getattr(loader, "dataset", None), getattr(loader, "dataset_path", None))  # noqa: E731
    if data(validator.dataloader) != data(training) or data(training) == (None, None):
        return []
    return [f"--validator.dataloader.dataset {validator.dataloader.dataset} is the training dataset (dataset_path "
            f"{validator.dataloader.dataset_path}): the validation loss is then measured on text the model trains "
            "on, not held-out text"]


class GlobalModelValidator(Validator):
    """torchtitan 0.3's ``Validator``, its ``validate()`` inside the container's global model."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        def __post_init__(self) -> None:
            # before torchtitan's own assertion, which says less (and only about steps)
            problems = validator_problems(self)
            if problems:
                refuse(ConfigError("\n".join(problems)))
            super(GlobalModelValidator.Config, self).__post_init__()

    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        with global_model_of(self.metrics_processor):
            super().validate(model_parts, step)


def with_global_model_validation(cfg: Any) -> Any:
    """``cfg`` with our validator, its settings kept."""
    if not isinstance(cfg.validator, GlobalModelValidator.Config):
        cfg.validator = GlobalModelValidator.Config(
            **{f.name: getattr(cfg.validator, f.name) for f in fields(cfg.validator) if f.init})
    return cfg
