"""Shared helpers of the benchmark scripts: model shapes on the meta device, optimizer configs,
launching ``titan_commopt.train`` under torchrun, the held-out evaluation's flags, and reading a run
back (its TensorBoard scalars; its console lines' times, to part training time from evaluation time)."""

import datetime
import functools
import glob
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "debug_cpu.toml"


def _on_03() -> bool:
    from titan_commopt.titan.line import installed_version, line_of

    return line_of(installed_version()) == "0.3"


def flavor_args(flavor: str):
    """The llama3 model config of ``flavor`` on the installed torchtitan line (0.2.2's
    ``TransformerModelArgs``, 0.3's ``Llama3Model.Config``), as that line's training builds it: our CPU
    flavors take the line's bundled tokenizer's vocabulary (0.2.2: SentencePiece, 1024 ids; 0.3 reads
    only a HuggingFace ``tokenizer.json``: byte-level BPE, 2000 ids), so their embedding and head
    differ between the lines; 0.3's attention also fuses wq/wk/wv into one ``wqkv``."""
    if _on_03():
        from titan_commopt.titan.tt03_toml.toml_config import model_spec

        return model_spec(flavor).model
    from torchtitan.models.llama3 import llama3_args

    from titan_commopt.titan.tt022.spec import EXTRA_FLAVORS

    return {**llama3_args, **EXTRA_FLAVORS}[flavor]


def flavor_names() -> list[str]:
    if _on_03():
        from titan_commopt.titan.tt03_toml.toml_config import flavor_names as names

        return names()
    from torchtitan.models.llama3 import llama3_args

    from titan_commopt.titan.tt022.spec import EXTRA_FLAVORS

    return list({**llama3_args, **EXTRA_FLAVORS})


def build_model(flavor: str) -> torch.nn.Module:
    """torchtitan's llama3 model of ``flavor`` on the installed line, on the current default device
    (``with torch.device("meta"): ...`` for shapes alone)."""
    args = flavor_args(flavor)
    if _on_03():
        return args.build()
    from torchtitan.models.llama3 import Transformer

    return Transformer(args)


def param_shapes(flavor: str) -> list[tuple[str, tuple[int, ...]]]:
    """(fqn, global shape) of every parameter of torchtitan's llama3 model (meta device), as the
    installed line trains it."""
    with torch.device("meta"):
        model = build_model(flavor)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@functools.cache  # a meta-device model per call: the study's tables ask for each flavor's size many times
def parameter_count(flavor: str) -> int:
    return sum(math.prod(shape) for _, shape in param_shapes(flavor))


# The [commopt] keys a benchmark varies (--set commopt.KEY=VALUE)
COMMON_KEYS = ("kernels", "clip_scope")


def parse_overrides(items: list[str]) -> dict[str, dict]:
    """``["local.Kx=2", "demo.chunk=32"]`` → ``{"local": {"Kx": 2}, "demo": {"chunk": 32}}``;
    ``commopt.kernels=triton`` (a key of :data:`COMMON_KEYS`) → ``{"commopt": {...}}``;
    an optimizer's name in place of its family (``DiLoCo.lr_scale=1``) → ``{"DiLoCo": {...}}``, for
    that optimizer alone (its family's other presets keep theirs; :func:`options_of`).
    A malformed item or an unknown family: ``ConfigError`` with one line."""
    import ast
    import difflib

    from titan_commopt.optim import FAMILIES, available_names, owns_replicate_sync
    from titan_commopt.options import ConfigError

    names = [n for n in available_names() if owns_replicate_sync(n)]
    out: dict[str, dict] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        family, dot, option = key.partition(".")
        if not eq or not dot or not family or not option:
            raise ConfigError(f"--set {item!r}: allowed is FAMILY.OPTION=VALUE or OPTIMIZER.OPTION=VALUE, "
                              f"e.g. demo.chunk=32, DiLoCo.lr_scale=1")
        if family == "commopt" and option not in COMMON_KEYS:
            raise ConfigError(f"--set {item!r}: of [commopt] only commopt.kernels=auto|torch|triton and "
                              "commopt.clip_scope=auto|replicas|replica are taken here")
        if family not in FAMILIES and family not in names and family != "commopt":
            close = difflib.get_close_matches(family, [*FAMILIES, *names], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"--set {item!r}: unknown family or optimizer {family!r}{hint} (known: "
                              f"{', '.join(FAMILIES)}; {', '.join(names)})")
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed = value
        out.setdefault(family, {})[option] = parsed
    return out


def resolved_of(name: str, overrides: dict[str, dict], hparams=None):
    """What ``name`` trains with given ``--set FAMILY.OPTION=VALUE`` / ``NAME.OPTION=VALUE`` overrides
    (the user's keys, :func:`options_of`): the registry's one resolution, preset on every key not overridden."""
    from titan_commopt.optim import resolve

    kernels = overrides.get("commopt", {}).get("kernels", "auto")
    return resolve(name, options_of(name, overrides), hparams, kernels=kernels)


def options_of(name: str, overrides: dict[str, dict]) -> dict:
    """The ``--set`` options ``name`` trains with: its family's, then its own (``NAME.OPTION``) over them."""
    from titan_commopt.optim import family_of

    return {**overrides.get(family_of(name).key, {}), **overrides.get(name, {})}


def cli_overrides(name: str, overrides: dict[str, dict]) -> list[str]:
    """The same overrides as torchtitan command-line flags (the optimizer's family's and its own, and
    ``[commopt]``'s :data:`COMMON_KEYS`)."""
    from titan_commopt.optim import family_of, owns_replicate_sync

    if not owns_replicate_sync(name):
        return []
    family = family_of(name).key
    out = [arg for key, value in overrides.get("commopt", {}).items() for arg in (f"--commopt.{key}", str(value))]
    for option, value in options_of(name, overrides).items():
        flag = f"--commopt.{family}.{option}"
        if isinstance(value, bool):
            out.append(flag if value else f"--commopt.{family}.no-{option}")
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def torchrun_cmd(nproc: int, dump: Path, *overrides: str, rdzv: list[str] | None = None, tee: bool = True,
                 config: Path = CONFIG, launcher: str = "torch.distributed.run") -> list[str]:
    """``tee=False``: the workers write straight to torchrun's stdout (no tailing thread in between,
    so a console line appears the moment it is printed; every local rank prints). ``launcher``
    ``titan_commopt.run``: torchrun with our config check first (a bad config: one line, exit 2)."""
    rdzv = rdzv or ["--standalone"]
    console = ["--local-ranks-filter", "0", "--role", "rank", "--tee", "3"] if tee else []
    return [
        sys.executable, "-m", launcher, f"--nproc_per_node={nproc}", *rdzv, *console,
        "-m", "titan_commopt.train", "--job.config_file", str(config),
        "--job.dump_folder", str(dump), "--metrics.disable_color_printing", *overrides,
    ]


def train_env(threads: int = 1) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_train(dump: Path, nproc: int, *overrides: str, timeout: int = 3600) -> subprocess.CompletedProcess:
    proc = subprocess.run(torchrun_cmd(nproc, dump, *overrides), cwd=ROOT, env=train_env(),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"training failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


# Held-out tokens each evaluation reads (issue 39's study: 32 steps of its 2048-token global batch).
EVAL_TOKENS = 65536


def eval_steps_for(tokens_per_eval_step: int) -> int:
    """``[validation] steps`` that read about :data:`EVAL_TOKENS` held-out tokens per evaluation."""
    return max(1, round(EVAL_TOKENS / tokens_per_eval_step))


def validation_flags(dataset: str, every: int, steps: int, local_batch: int, seq_len: int) -> list[str]:
    """torchtitan's ``[validation]`` on the held-out twin of the training corpus ``dataset``
    (``titan_commopt.corpora.HELD_OUT``), every ``every`` steps (torchtitan also evaluates step 1),
    ``steps`` batches of the training's local batch each time. An unknown corpus: ``KeyError``."""
    from titan_commopt.corpora import HELD_OUT

    return ["--validation.enable", "--validation.dataset", HELD_OUT[dataset], "--validation.freq", str(every),
            "--validation.steps", str(steps), "--validation.local_batch_size", str(local_batch),
            "--validation.seq_len", str(seq_len)]


class Timeline:
    """When each training step and each evaluation ended, from torchtitan's console lines
    (``step: N  loss: X`` after step N, ``validate step: N  loss: X`` after the evaluation that
    follows it; the first line of each step counts: every rank prints, and our metrics add a second
    ``step:`` line per step).

    A line's time is its ``[titan] YYYY-MM-DD HH:MM:SS,mmm`` stamp (``time.time()``'s clock), else
    the ``arrival`` given. torchtitan evaluates between a step's console line and the next step, so
    an evaluation took ``evals[k] - steps[k]``; :meth:`training_seconds` leaves those out."""

    LINE = re.compile(r"(?:\[titan\] (?P<when>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?)?"
                      r"(?P<validate>validate )?step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+0-9.eE]+|nan|inf)")

    def __init__(self) -> None:
        self.steps: dict[int, float] = {}
        self.losses: dict[int, float] = {}
        self.evals: dict[int, float] = {}
        self.eval_losses: dict[int, float] = {}

    @classmethod
    def of(cls, text: str) -> "Timeline":
        timeline = cls()
        for line in text.splitlines():
            timeline.add(line)
        return timeline

    def add(self, line: str, arrival: float | None = None) -> tuple[str, int] | None:
        """Reads one console line; returns ``("step" | "validate", N)`` the first time it sees that
        step's line of that kind, else None."""
        m = self.LINE.search(line)
        if not m:
            return None
        when = arrival
        if m["when"]:
            when = datetime.datetime.strptime(m["when"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        times, losses, kind = ((self.evals, self.eval_losses, "validate") if m["validate"]
                               else (self.steps, self.losses, "step"))
        step = int(m["step"])
        if step in times or when is None:
            return None
        times[step], losses[step] = when, float(m["loss"])
        return kind, step

    def eval_seconds(self, before: int | None = None) -> float:
        """Seconds spent evaluating after the steps before ``before`` (all evaluations: None)."""
        return sum(t - self.steps[k] for k, t in self.evals.items() if k in self.steps and (before is None or k < before))

    def training_seconds(self, upto: int) -> float:
        """Wall clock from the first step's line to step ``upto``'s, less the evaluations in between:
        the first step (start-up, first compilations) is left out, alike for every run."""
        first = min(self.steps)
        return self.steps[upto] - self.steps[first] - self.eval_seconds(before=upto) + self.eval_seconds(before=first)


def read_scalars(dump: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict = {}
    for run in sorted(glob.glob(str(Path(dump) / "tb" / "*"))):
        acc = EventAccumulator(run, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return {k: sorted(v) for k, v in out.items()}


def last(scalars: dict, tag: str) -> float:
    return scalars[tag][-1][1]


def table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-markdown table."""
    cells = [[str(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"
