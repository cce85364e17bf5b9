"""The run: what one training run is made of, made once and handed to the builders.

:meth:`CommoptRun.from_command_line` parses the command line and its TOML once
(``config/parse.py``), checks every value and resolves the optimizer
(``config/validate.py``: ``CheckedJob``): the parsed job config, the ``[commopt]`` keys the user set, the
resolved options (``None`` for torchtitan's AdamW/Adam), the warnings about the config (one line
each, printed once by ``titan_commopt.train``/``titan_commopt.run``) and the run's comm ledger (every byte a
training step sends, recorded by the optimizers, the container and FSDP2's estimates alike). The
topology is added once the meshes exist (``build.py``).

``titan_commopt.train`` makes it before any process group exists and hands it to our Trainer
(``trainer.py``), which binds it into the TrainSpec torchtitan builds from (``spec.py:
bind_run``). Launched through plain ``torchtitan.train`` with our custom import, the spec's
builders get no run: the optimizer builder makes it then from ``sys.argv`` (torchtitan gives it
no job config).
"""

import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from titan_commopt.comm import CommLedger
from titan_commopt.options import ConfigError
from titan_commopt.topology import Topology

from ..config.parse import CUSTOM_IMPORT, parse_job
from ..config.validate import CheckedJob
from .checks import spec_problems

__all__ = ["CommoptRun"]


@dataclass
class CommoptRun(CheckedJob):
    ledger: CommLedger = field(default_factory=CommLedger)
    topology: Optional[Topology] = None  # once the meshes exist
    # live fault tolerance (common/replica_group_training.ReplicaGroupTraining), made by our Trainer
    fault_tolerance: Optional[Any] = None

    @classmethod
    def from_command_line(cls, argv: Optional[list[str]] = None, world_size: Optional[int] = None) -> "CommoptRun":
        """Parse ``argv`` (default ``sys.argv[1:]``) and resolve its optimizer without touching
        torch.distributed; ``ConfigError`` lists every problem. ``world_size`` defaults to
        torchrun's ``WORLD_SIZE`` (unset: the mesh is not checked against it)."""
        parsed = parse_job(list(sys.argv[1:] if argv is None else argv))
        _import_custom(parsed.job_config)
        return cls.of(parsed, world_size, spec_problems)


def _import_custom(job_config: Any) -> None:
    """The user's ``[experimental] custom_import`` (torchtitan imports it in ``Trainer.__init__``):
    needed now so that the model names it registers are known to the checks."""
    module = job_config.experimental.custom_import
    if module and module != CUSTOM_IMPORT:
        try:
            importlib.import_module(module)
        except Exception as error:
            raise ConfigError(
                f"[experimental] custom_import = {module!r}: cannot import it ({type(error).__name__}: {error})"
            ) from error
