"""A run's checkpoint as the resume check (``resume.py``) reads it, on either torchtitan line: the
settings that say which checkpoint is loaded, how a message spells them, and the keys our container
writes into the optimizer's part of it.

Both lines save DCP checkpoints alike (``<dump_folder>/<checkpoint.folder>/step-N``, complete once
``.metadata`` is written; the newest complete one loaded unless ``load_step``; the states of
``exclude_from_loading`` left out; flat keys ``optimizer.*``, ``dataloader.dp_rank_<r>``, ...), and
their ``checkpoint`` settings have the same names; they differ in where the dump folder is
(0.2.2: ``[job] dump_folder``; 0.3: ``Trainer.Config.dump_folder``), where the optimizer's name is,
and how the user writes a setting: a TOML (0.2.2, and our TOML runner on 0.3) or 0.3's command line
(``--checkpoint.load_step 4``, a config module's or an override's run). :class:`CheckpointSettings`
carries the first, :class:`Spelling` the second, so that a refusal names the setting as the user
would type it.

Our keys (under torchtitan's ``optimizer.``): an optimizer that owns R saves its state once per
replica under :func:`replica_prefix` (``replica<r>/``), each copy with :data:`RESOLVED_KEY` (the
resolved options, JSON) and :data:`LEDGER_KEY` (the comm ledger's totals, JSON); torchtitan's own
AdamW/Adam saves one copy, with :data:`LEDGER_KEY`. ``common/replica_checkpoint.py`` writes them."""

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["CheckpointSettings", "Spelling", "TOML", "CLI", "RESOLVED_KEY", "LEDGER_KEY", "REPLICA_KEY", "replica_prefix"]

RESOLVED_KEY = "commopt_resolved"  # the resolved options (JSON) in each replica's optimizer state
LEDGER_KEY = "comm_ledger"  # the comm ledger's totals and step count (JSON)
REPLICA_KEY = re.compile(r"^optimizer\.replica(\d+)/")  # a checkpoint key of replica <r>'s state


def replica_prefix(replica: int) -> str:
    """Where replica ``replica``'s optimizer state is, under torchtitan's ``optimizer.``."""
    return f"replica{replica}/"


@dataclass(frozen=True)
class Spelling:
    """How a message names a setting: ``cli`` False, the TOML's ``[section] key = value``; True,
    torchtitan 0.3's command line ``--section.key value`` (``[commopt.*]`` is ``--optimizer.commopt.*``)."""

    cli: bool

    def key(self, section: str, key: str) -> str:
        if not self.cli:
            return f"[{section}] {key}"
        return f"--{self._section(section)}.{key}"

    def table(self, section: str) -> str:
        """A whole section: ``[commopt.demo]`` / ``--optimizer.commopt.demo.*``."""
        return f"--{self._section(section)}.*" if self.cli else f"[{section}]"

    def setting(self, section: str, key: str, value: Any, short: bool = False) -> str:
        """``key`` set to ``value`` (``short``: without the TOML's ``[section]``)."""
        if not self.cli:
            return f"{key if short else self.key(section, key)} = {_toml(value)}"
        name = self.key(section, key)
        if isinstance(value, bool):
            return name if value else f"--{self._section(section)}.no-{key}"
        words = value if isinstance(value, (list, tuple)) else [value]
        return " ".join([name, *map(str, words)])

    def shown(self, section: str, key: str, shown: str, short: bool = False) -> str:
        """``key`` with a value already shown as text: ``[s] k = v`` (``short``: ``k = v``) / ``--s.k v``."""
        if self.cli:
            return f"{self.key(section, key)} {shown}"
        return f"{key if short else self.key(section, key)} = {shown}"

    @staticmethod
    def _section(section: str) -> str:
        return f"optimizer.{section}" if section == "commopt" or section.startswith("commopt.") else section


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value))
    return repr(value) if isinstance(value, str) else str(value)


TOML = Spelling(cli=False)
CLI = Spelling(cli=True)


@dataclass(frozen=True)
class CheckpointSettings:
    """A run's checkpoint settings, its optimizer's name and how its settings are written."""

    dump_folder: str
    enable: bool
    folder: str
    load_step: int
    exclude_from_loading: tuple[str, ...]
    initial_load_path: Optional[str]
    optimizer_name: str
    spelling: Spelling = TOML

    @classmethod
    def of_job_config(cls, job_config: Any) -> "CheckpointSettings":
        """torchtitan 0.2.2's ``JobConfig`` (or our TOML parsed on 0.3): ``[job] dump_folder``,
        ``[checkpoint]``, ``[optimizer] name``."""
        return cls._of(job_config.job.dump_folder, job_config.checkpoint, job_config.optimizer.name, TOML)

    @classmethod
    def of_trainer_config(cls, config: Any, optimizer_name: str, spelling: Spelling = CLI) -> "CheckpointSettings":
        """torchtitan 0.3's ``Trainer.Config`` (its ``dump_folder`` and ``checkpoint``)."""
        return cls._of(config.dump_folder, config.checkpoint, optimizer_name, spelling)

    @classmethod
    def _of(cls, dump_folder: str, ckpt: Any, name: str, spelling: Spelling) -> "CheckpointSettings":
        return cls(
            dump_folder=dump_folder, enable=bool(ckpt.enable), folder=ckpt.folder, load_step=ckpt.load_step,
            exclude_from_loading=tuple(ckpt.exclude_from_loading or ()),
            initial_load_path=getattr(ckpt, "initial_load_path", None), optimizer_name=name, spelling=spelling,
        )
