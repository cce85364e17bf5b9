"""The torchtitan plug-in: the only package that imports torchtitan.

Two torchtitan lines are supported (``line.py`` tells which is installed; any other version stops
with one line, exit status 2). The folders say which line a file serves:

- ``common/``: what both lines run the same way: the optimizer container (its safeguards, clipping,
  per-replica checkpoint state), building it, the metrics a log step adds, torchtitan's ``main()``
  body, the meshes → R/S/T, the offline data;
- ``tt022/`` (torchtitan 0.2.2): the run, our Trainer, the TrainSpecs and what they build, the
  SentencePiece tokenizer;
- ``tt03/`` (torchtitan 0.3.x, its own ways): the container as a ``Configurable``, the config module
  (``--module titan_commopt.titan.tt03.configs``), the ``@override`` functions, the ``fully_shard`` wrapper, the
  CPU fixes, the BPE tokenizer;
- ``tt03_toml/`` (torchtitan 0.3.x, our 0.2.2 TOML): the TOML's keys, parsed, made into 0.3's
  config, trained;
- ``config/``: the user's config checked before any process group exists (the ``[commopt]``
  section, the parse, the values, the resume check); ``titan_commopt.titan.config`` is what
  ``--job.custom_config_module`` names;
- ``platform/``: the machine and the process around a run (CPU, console noise, torchrun restarts,
  stopping a run with one line);
- ``v03/``: earlier releases' 0.3 paths, forwarding to ``tt03/``.

``platform/`` imports nothing of the others, ``config/`` only ``platform/``, ``common/`` those two,
and a line's folder those three (``tt03_toml/`` also ``tt03/``).

On 0.2.2 importing it registers the TrainSpecs (``llama3_commopt``, ``llama3_reference``) and the
offline datasets, so ``--experimental.custom_import titan_commopt.titan`` is all torchtitan needs. It
happens before torchtitan initializes the process group, which is when a torchrun restart that
would hang is worth a line on the console (``platform/elastic.py``). On 0.3 importing it installs
the ``fully_shard`` wrapper that leaves R to our optimizers (``tt03/fsdp.py``); the config module and
the overrides import it.
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
