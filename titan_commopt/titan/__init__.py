"""The torchtitan adapter: the only package that imports torchtitan.

Importing it registers the TrainSpecs (``llama3_commopt``, ``llama3_reference``) and the offline
datasets, so ``--experimental.custom_import titan_commopt.titan`` is all torchtitan needs. It happens
before torchtitan initializes the process group, which is when a torchrun restart that would hang
is worth a line on the console (``titan/elastic.py``).
"""

from .elastic import warn_if_restart_would_hang
from .spec import COMMOPT_SPEC, REFERENCE_SPEC, register

register()
warn_if_restart_would_hang()

__all__ = ["COMMOPT_SPEC", "REFERENCE_SPEC", "register"]
