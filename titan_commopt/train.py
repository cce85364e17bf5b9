"""Entry point: torchtitan 0.2.2's own Trainer with titan_commopt plugged in.

    torchrun --nproc_per_node=2 -m titan_commopt.train --job.config_file train_configs/debug_cpu.toml

Differences from ``python -m torchtitan.train``, all before torchtitan's Trainer starts:

1. on a machine without an accelerator, torchtitan is pointed at the CPU (``titan/cpu.py``);
2. ``--job.custom_config_module`` / ``--experimental.custom_import`` default to ours, so the
   ``[commopt]`` section and our TrainSpecs exist whatever the TOML says;
3. ``[optimizer] name`` and every ``[commopt]`` key/value are checked before any process group
   exists: a bad value exits with status 2 and one line per problem (key, value, what is allowed).
"""

import os
import sys
from typing import Optional

CONFIG_MODULE = "titan_commopt.titan.config"
CUSTOM_IMPORT = "titan_commopt.titan"


def _toml_of(argv: list[str]) -> dict:
    from .titan.config import config_file_of, read_toml

    return read_toml(config_file_of(argv))


def _has_flag(argv: list[str], names: tuple[str, ...]) -> bool:
    return any(arg.partition("=")[0] in names for arg in argv)


def plugin_args(argv: list[str], toml: dict) -> list[str]:
    """``argv`` plus our config module and custom import unless the CLI or TOML names them."""
    extra = []
    if not _has_flag(argv, ("--job.custom_config_module", "--job.custom-config-module")) and not toml.get(
        "job", {}
    ).get("custom_config_module"):
        extra += ["--job.custom_config_module", CONFIG_MODULE]
    if not _has_flag(argv, ("--experimental.custom_import", "--experimental.custom-import")) and not toml.get(
        "experimental", {}
    ).get("custom_import"):
        extra += ["--experimental.custom_import", CUSTOM_IMPORT]
    return list(argv) + extra


def check_config(argv: list[str]):
    """Parse the job config and resolve its optimizer without touching torch.distributed.
    Returns ``(job_config, resolved)`` (``resolved`` is None for torchtitan's own optimizers);
    raises ConfigError."""
    from titan_commopt.options import ConfigError, check_keys

    from .titan import config as commopt_config
    from .titan.validate import resolve_job

    toml = _toml_of(argv)
    unknown = check_keys(toml.get("commopt", {}), commopt_config.CommOpt, "commopt")
    if unknown:
        raise ConfigError("\n".join(unknown))
    from torchtitan.config import ConfigManager

    args = plugin_args(argv, toml)
    job_config = ConfigManager().parse_args(args)
    return job_config, resolve_job(job_config, args)


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .titan.cpu import use_cpu_if_no_accelerator

    use_cpu_if_no_accelerator()
    from titan_commopt.options import ConfigError

    import titan_commopt.titan  # noqa: F401  (registers the TrainSpecs)

    from .titan.validate import remember

    try:
        job_config, resolved = check_config(argv)
        remember(job_config, resolved)
    except ConfigError as error:
        if os.environ.get("RANK", "0") == "0":
            print(f"titan_commopt: bad config:\n{error}", file=sys.stderr)
        raise SystemExit(2)

    import torchtitan.train as torchtitan_train

    from .titan import config as commopt_config

    class Trainer(torchtitan_train.Trainer):
        """torchtitan's Trainer; remembers its job config for our ``build_optimizers_fn``."""

        def __init__(self, job_config):
            commopt_config.set_current(job_config)
            super().__init__(job_config)

    sys.argv = [sys.argv[0]] + plugin_args(argv, _toml_of(argv))
    torchtitan_train.main(Trainer)


if __name__ == "__main__":
    main()
