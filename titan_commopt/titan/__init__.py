"""The torchtitan adapter: the only package that imports torchtitan.

- ``adapter/``: what plugs into torchtitan (the run, the Trainer, the TrainSpecs, the optimizer
  builder and container, the parallelize wrapper, clipping, metrics, the offline data);
- ``config/``: config checking, before any process group exists (the ``[commopt]`` section, the
  parse, the values, the resume check); ``titan_commopt.titan.config`` is what
  ``--job.custom_config_module`` names;
- ``platform/``: the machine and the process around a run (CPU, console noise, torchrun restarts,
  stopping a run with one line).

Importing it registers the TrainSpecs (``llama3_commopt``, ``llama3_reference``) and the offline
datasets, so ``--experimental.custom_import titan_commopt.titan`` is all torchtitan needs. It happens
before torchtitan initializes the process group, which is when a torchrun restart that would hang
is worth a line on the console (``platform/elastic.py``).
"""

from .adapter.spec import COMMOPT_SPEC, REFERENCE_SPEC, register
from .platform.elastic import warn_if_restart_would_hang

register()
warn_if_restart_would_hang()

__all__ = ["COMMOPT_SPEC", "REFERENCE_SPEC", "register"]
