"""Deprecated: ``--module titan_commopt.titan.tt03.configs``, the same config functions."""

from ..tt03.configs import *  # noqa: F403  (the config functions torchtitan looks up by name)
from ..tt03.configs import __all__  # noqa: F401
from ..tt03.configs import __dir__, __getattr__  # noqa: F401  (stock configs by name; an unknown --config: one line)
from . import announce_moved

announce_moved("--module titan_commopt.titan.v03.configs", "--module titan_commopt.titan.tt03.configs")
