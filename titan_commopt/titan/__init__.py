"""The torchtitan adapter: the only package that imports torchtitan.

Two torchtitan lines are supported, each behind its own adapter (``line.py`` tells which is
installed; any other version stops with one line, exit status 2):

- ``adapter/`` (torchtitan 0.2.2): what plugs into torchtitan (the run, the Trainer, the
  TrainSpecs, the optimizer builder and container, the parallelize wrapper, clipping, metrics, the
  offline data);
- ``v03/`` (torchtitan 0.3.x): the optimizer container as a ``Configurable``, its ``@override``,
  the config module (``--module titan_commopt.titan.v03.configs``), the CPU fixes;
- ``shared/``: what both lines read the same way (the meshes → R/S/T, the bundled corpus);
- ``config/``: config checking, before any process group exists (the ``[commopt]`` section, the
  parse, the values, the resume check); ``titan_commopt.titan.config`` is what
  ``--job.custom_config_module`` names;
- ``platform/``: the machine and the process around a run (CPU, console noise, torchrun restarts,
  stopping a run with one line).

On 0.2.2 importing it registers the TrainSpecs (``llama3_commopt``, ``llama3_reference``) and the
offline datasets, so ``--experimental.custom_import titan_commopt.titan`` is all torchtitan needs. It
happens before torchtitan initializes the process group, which is when a torchrun restart that
would hang is worth a line on the console (``platform/elastic.py``). On 0.3 importing it installs
the FSDP wrapper that leaves R to our optimizers (``v03/fsdp.py``); the config module and the
override import it.
"""

from .line import require_supported_line

from .platform.elastic import warn_if_restart_would_hang

LINE = require_supported_line()

if LINE == "0.2":
    from .common.model import COMMOPT_SPEC, REFERENCE_SPEC
    from .tt022.spec import register

    register()
    __all__ = ["LINE", "COMMOPT_SPEC", "REFERENCE_SPEC", "register"]
else:
    from .tt03.fsdp import install as _install_fsdp_wrapper

    _install_fsdp_wrapper()
    __all__ = ["LINE"]
warn_if_restart_would_hang()
