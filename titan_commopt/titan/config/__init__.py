"""Config checking: everything between the command line and a run's resolved optimizer, before any
process group exists, and the resume check before anything is built; for both torchtitan lines.

- ``section.py``: the ``[commopt]`` section (``JobConfig``, exported here: ``--job.custom_config_module
  titan_commopt.titan.config`` names this package);
- ``sources.py``: the TOML file and the keys the user set;
- ``parse.py``: command line + TOML → torchtitan's JobConfig, every input mistake one line (on 0.3
  the same parse against 0.2.2's keys: ``tt03_toml/toml_config.py``);
- ``validate.py`` and ``torchtitan_keys.py``: the values, ``[optimizer]`` + ``[commopt]`` → ``Resolved``
  (what depends on the line's model registry is handed in: ``tt022/checks.py``,
  ``tt03_toml/toml_config.py``);
- ``resume.py`` and ``checkpoint.py``: the checkpoint a resume would load, checked against the run.
"""

from .section import MODULE, CommonOptions, CommOpt, JobConfig, commopt_of, family_config

__all__ = ["JobConfig", "CommOpt", "CommonOptions", "MODULE", "commopt_of", "family_config"]
