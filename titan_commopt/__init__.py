"""titan_commopt: communication-efficient optimizers for torchtitan, every byte counted.

Pure-PyTorch layers (usable without torchtitan): ``topology``, ``comm``, ``compress``, ``optim``.
The torchtitan adapter lives in ``titan_commopt.titan`` (importing it registers the TrainSpecs).
"""

__version__ = "0.1.0"
