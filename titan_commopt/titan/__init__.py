"""The torchtitan adapter: the only package that imports torchtitan.

Importing it registers the TrainSpecs (``llama3_commopt``, ``llama3_reference``) and the offline
datasets, so ``--experimental.custom_import titan_commopt.titan`` is all torchtitan needs.
"""

from .spec import COMMOPT_SPEC, REFERENCE_SPEC, register

register()

__all__ = ["COMMOPT_SPEC", "REFERENCE_SPEC", "register"]
