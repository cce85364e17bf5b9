"""A torchtitan 0.2.2 TOML (``--job.config_file X.toml`` and ``--section.key value``) → torchtitan
0.3's ``Trainer.Config``, checked before any process group exists.

The TOML and the command line are parsed as on 0.2.2 (``titan/config/parse.py``: the same checks,
the same one-line messages, tyro with the TOML as defaults, booleans as ``--k true|false`` or flags,
the last occurrence wins) against torchtitan 0.2.2's keys as written in ``toml_schema.py``. Every
key then goes where ``toml_schema.py`` says; a key with no 0.3 counterpart that the TOML or the
command line sets is one line (key, value, why), exit status 2. A key the TOML leaves out means
what it meant on 0.2.2 (its 0.2.2 default), not what 0.3's config function happens to set.

What is mapped by hand (:func:`trainer_config`):

- ``[model] name, flavor``: llama3's flavors by 0.3's model registry; our own (``cpu_tiny``,
  ``cpu_small``, ``100M``, ``300M``, our ``1B``) built with the same builders from their 0.2.2
  shapes (``common/model.py``);
- ``[model] hf_assets_path = "bundled"``: the HuggingFace tokenizer built from the bundled corpus
  (``tt03/assets.py``; the CPU flavors' vocabulary is its); the datasets ``commopt_tiny``,
  ``commopt_world`` and ``textfile`` are registered in 0.3's dataset registry as on 0.2.2
  (``common/data.py``), and read the same text;
- ``[optimizer]`` + ``[commopt]``: for ``llama3_commopt``, our 0.3 container
  (``tt03/configs.py: commopt_optimizer``; AdamW/Adam too, as on 0.2.2), the ``[commopt.<family>]``
  keys the user set passed as set on purpose; for ``llama3``/``llama3_reference``, torchtitan's
  container with one param group (lr, betas, eps, weight_decay);
- ``[validation]``: 0.3's validator, evaluating the global model as on 0.2.2 (``tt03/validate.py``);
  ``local_batch_size`` and ``seq_len`` only at ``[training]``'s values (0.3's validator reads batches of
  that shape);
- ``[activation_checkpoint] mode``: ``none`` → no AC, ``full`` → ``FullAC``, ``selective`` with
  ``selective_ac_option = "op"`` → ``SelectiveAC``, ``memory_budget`` → ``MemoryBudgetAC``; 0.3 has
  no layer-wise selective AC (an integer ``selective_ac_option``).
"""

import dataclasses
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Mapping, Optional

from titan_commopt.optim import family_of, owns_replicate_sync
from titan_commopt.options import ConfigError

from ..common.data import is_bundled_tokenizer, register_datasets, text_dataset_problems, tokenizer_corpus
from ..common.model import COMMOPT_SPEC, FLAVOR_SHAPES, REFERENCE_SPEC
from ..config.parse import CONFIG_MODULE, CUSTOM_IMPORT, ParsedJob, field_of, parse_with
from ..config.tokenizer_files import first_damaged, huggingface_files
from ..config.validate import CheckedJob
from .toml_schema import BY_HAND, SECTIONS_GONE, WIRING, Gone, key_of, schema_class

__all__ = ["TomlRun", "parse_toml", "trainer_config", "spec_problems", "MODEL_NAMES", "flavor_names", "model_spec"]

MODEL_NAMES = ("llama3", COMMOPT_SPEC, REFERENCE_SPEC)  # what [model] name may say on 0.3
_OURS = {"job.custom_config_module": CONFIG_MODULE, "experimental.custom_import": CUSTOM_IMPORT}



# ---- the parse ------------------------------------------------------------------------------------
def _schema(args: list[str], toml: Mapping[str, Any]) -> type:
    return schema_class()


def _dict_to_dataclass(cls: type, data: Mapping[str, Any]) -> Any:
    """The TOML as the defaults tyro parses the command line over (as 0.2.2's ConfigManager)."""
    kwargs = {}
    for f in fields(cls):
        if f.name in data:
            value = data[f.name]
            kwargs[f.name] = _dict_to_dataclass(f.type, value) if is_dataclass(f.type) else value
    return cls(**kwargs)


def _tyro_parse(cls: type, args: list[str], toml: dict) -> Any:
    import tyro

    return tyro.cli(cls, args=args, default=_dict_to_dataclass(cls, toml))


def _given(toml: Mapping[str, Any], args: list[str], cls: type) -> dict[str, tuple[Any, str]]:
    """``{section.key: (value, where)}`` of every key the TOML or the command line sets (the
    command line's last occurrence), outside ``[commopt]``."""
    out: dict[str, tuple[Any, str]] = {}

    def walk(table: Mapping[str, Any], prefix: str) -> None:
        for name, value in table.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{name}.")
            else:
                out[prefix + name] = (value, "")

    walk({k: v for k, v in toml.items() if k != "commopt" and isinstance(v, Mapping)}, "")
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if not key.startswith("--"):
            continue
        dotted, f, negated = field_of(cls, key[2:])
        if f is None or dotted.startswith("commopt."):
            continue
        if f.type is bool:  # a flag once normalized: --k / --section.no-k
            value = not negated
        elif not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        out[dotted] = (value, f" (from {key})")
    return out


def _gone_problems(toml: dict, args: list[str], cls: type) -> list[str]:
    """One line per key set that has no 0.3 counterpart, and per plug-in wiring that is not ours.
    Takes the sections that are gone as a whole out of ``toml`` (no second line about them)."""
    out = []
    for section, gone in SECTIONS_GONE.items():
        if section in toml:
            out.append(f"[{section}]: no torchtitan 0.3 counterpart ({gone.why})")
            del toml[section]
    for dotted, (value, where) in _given(toml, args, cls).items():
        key = key_of(dotted)
        if key is None:
            continue  # unknown: toml_problems / cli_problems name it
        section, _, name = dotted.rpartition(".")
        if isinstance(key.to, Gone):
            out.append(f"[{section}] {name} = {value!r}{where}: no torchtitan 0.3 counterpart ({key.to.why})")
        elif key.to == WIRING and dotted in _OURS and value not in ("", _OURS[dotted]):
            out.append(
                f"[{section}] {name} = {value!r}{where}: no torchtitan 0.3 counterpart (0.3 has no JobConfig "
                f"extension or custom import; allowed is {_OURS[dotted]!r}, the plug-in itself; for your own "
                f"settings use a config module: --module M --config F)"
            )
    return out


def parse_toml(argv: list[str]) -> ParsedJob:
    """``argv`` (``--job.config_file X.toml`` + overrides) parsed against torchtitan 0.2.2's keys."""
    return parse_with(argv, _schema, _tyro_parse, more_problems=_gone_problems)


# ---- model, tokenizer, data checks (0.3's counterpart of tt022/checks.py) ---------------------------
def flavor_names() -> list[str]:
    """Every flavor ``[model] flavor`` may name on 0.3: llama3's and ours (``common/model.py``)."""
    from torchtitan.models.llama3 import llama3_configs

    return sorted(set(llama3_configs) | set(FLAVOR_SHAPES))


def _tokenizer_problems(model: Any) -> list[str]:
    """0.3 reads a HuggingFace tokenizer.json from ``hf_assets_path`` (no SentencePiece .model);
    ``bundled``: the one built from the bundled corpus. Worded as on 0.2.2 (``torchtitan_keys.py``)."""
    import os

    path = (model.hf_assets_path or "").strip()
    ours = model.name in (COMMOPT_SPEC, REFERENCE_SPEC)  # the specs that know our bundled tokenizer
    if ours and is_bundled_tokenizer(path):
        return []
    where = f"[model] hf_assets_path = {model.hf_assets_path!r}"
    if ours:
        allowed = ('allowed is "bundled" (the offline tokenizer) or a directory with tokenizer.json (HuggingFace; '
                   "torchtitan 0.3 reads no SentencePiece tokenizer.model)")
        missing = "no such file or directory"
    else:
        allowed = f"allowed is a directory with tokenizer.json (model {model.name!r})"
        missing = "not a directory" if os.path.exists(path) else "no such directory"
    if not os.path.isdir(path):
        return [f"{where}: {missing}; {allowed}"]
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return [f"{where}: holds no tokenizer.json; {allowed}"]
    problem = first_damaged(path, huggingface_files(path, chat_template=True))
    if problem:
        return [f"{where}: {problem}; {allowed}"]
    return []


def spec_problems(job_config: Any, lines_needed: int) -> list[str]:
    """0.3's counterpart of ``tt022/checks.py: spec_problems``: model name and flavor, tokenizer,
    datasets (our bundled and ``textfile`` datasets are registered in 0.3's registry alike)."""
    model, name = job_config.model, job_config.optimizer.name
    out = []
    if model.name not in MODEL_NAMES:
        out.append(f"[model] name = {model.name!r}: allowed is one of {', '.join(MODEL_NAMES)}")
    elif owns_replicate_sync(name) and model.name != COMMOPT_SPEC:
        out.append(
            f"[model] name = {model.name!r} with [optimizer] name = {name!r}: allowed is {COMMOPT_SPEC!r} "
            f"(the TrainSpec that builds titan_commopt optimizers; {model.name!r} knows only AdamW and Adam)"
        )
    flavors = flavor_names()
    if model.flavor not in flavors:
        out.append(f"[model] flavor = {model.flavor!r}: allowed is one of {', '.join(flavors)} (model {model.name!r})")
    out += _tokenizer_problems(model)
    return out + text_dataset_problems(job_config, lines_needed)


# ---- the run --------------------------------------------------------------------------------------
@dataclass
class TomlRun(CheckedJob):
    """What ``titan_commopt.train`` makes on torchtitan 0.3 before any process group: the TOML as
    parsed (0.2.2's keys) and checked, and 0.3's ``Trainer.Config`` built from it."""

    trainer_config: Any = None

    @classmethod
    def from_command_line(cls, argv: list[str], world_size: Optional[int] = None) -> "TomlRun":
        register_datasets()  # the bundled corpora and textfile, as on 0.2.2 (in every process)
        run = cls.of(parse_toml(list(argv)), world_size, spec_problems)
        run.trainer_config = trainer_config(run.job_config, run.user_keys)
        return run


# ---- Trainer.Config -------------------------------------------------------------------------------
def _set(target: Any, dotted: str, value: Any) -> None:
    *path, name = dotted.split(".")
    for part in path:
        target = getattr(target, part)
    setattr(target, name, list(value) if isinstance(value, list) else value)


def model_spec(flavor: str, vocab_size: Optional[int] = None) -> Any:
    """0.3's ModelSpec of a llama3 flavor (0.3's registry, or :data:`FLAVOR_SHAPES` built alike);
    ``vocab_size`` of our CPU flavors: the bundled tokenizer's (``assets.VOCAB_SIZE``) unless given."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim

    if flavor not in FLAVOR_SHAPES:
        return llama3.model_registry(flavor)
    from ..tt03 import assets

    shape = {**FLAVOR_SHAPES[flavor]}
    vocab = shape.pop("vocab_size") or vocab_size or assets.VOCAB_SIZE
    dim, n_heads = shape["dim"], shape["n_heads"]
    model = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=shape["n_layers"], dim=dim, n_heads=n_heads, n_kv_heads=shape.get("n_kv_heads"),
            hidden_dim=compute_ffn_hidden_dim(
                dim, multiple_of=shape["multiple_of"], ffn_dim_multiplier=shape.get("ffn_dim_multiplier")
            ),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=shape.get("rope_theta", 10000.0)),
            attn_backend="flex",
        ),
    )
    spec = llama3.model_registry("debugmodel")
    return dataclasses.replace(spec, flavor=flavor, model=model)


def _activation_checkpoint(ac: Any) -> Any:
    from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC

    common = dict(preserve_rng_state=ac.preserve_rng_state, determinism_check=ac.determinism_check, debug=ac.debug)
    if ac.mode == "none":
        return None
    if ac.mode == "full":
        return FullAC.Config(**common)
    if ac.mode == "memory_budget":
        return MemoryBudgetAC.Config(
            memory_budget=ac.memory_budget, visualize_memory_budget_pareto=ac.visualize_memory_budget_pareto, **common
        )
    if ac.selective_ac_option != "op":
        raise ConfigError(
            f"[activation_checkpoint] selective_ac_option = {ac.selective_ac_option!r} (mode = 'selective'): no "
            f"torchtitan 0.3 counterpart (0.3 has no layer-wise selective AC); allowed is \"op\" (per-op "
            f"selective), or mode = \"full\" | \"memory_budget\" | \"none\""
        )
    return SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=list(ac.per_op_sac_force_recompute_mm_shapes_by_fqns),
                              **common)


def _optimizer(job_config: Any, user_keys: Mapping[str, set[str]]) -> Any:
    """``[optimizer]`` (+ ``[commopt]``): our container for ``llama3_commopt`` (its AdamW too: the
    ledger counts FSDP's bytes), torchtitan's own for the stock ``llama3``/``llama3_reference``.
    ``user_keys``: the ``[commopt.<family>]`` keys the user set, kept even at their default (the
    preset fills only the others, as on 0.2.2)."""
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    opt = job_config.optimizer
    hparams = dict(lr=opt.lr, beta1=opt.beta1, beta2=opt.beta2, eps=opt.eps, weight_decay=opt.weight_decay)
    if job_config.model.name == COMMOPT_SPEC:
        from ..tt03.configs import commopt_optimizer

        set_keys = sorted(user_keys.get(family_of(opt.name).key, ())) if owns_replicate_sync(opt.name) else []
        return commopt_optimizer(opt.name, job_config.commopt, warmup_steps=job_config.lr_scheduler.warmup_steps,
                                 implementation=opt.implementation, set_keys=tuple(set_keys), **hparams)
    kwargs = {"lr": opt.lr, "betas": (opt.beta1, opt.beta2), "eps": opt.eps, "weight_decay": opt.weight_decay}
    return OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=opt.name, optimizer_kwargs=kwargs)],
        implementation=opt.implementation,
    )


def _same_batches_as_training(validation: Any, training: Any) -> None:
    """``[validation] local_batch_size`` and ``seq_len``: torchtitan 0.3's validator reads batches of
    ``[training]``'s shape, so a TOML may name them only at those values (left out, they are 0.2.2's
    defaults, 8 and 2048). ConfigError otherwise, one line each."""
    lines = [f"[validation] {key} = {getattr(validation, key)!r}: torchtitan 0.3's validator reads batches of "
             f"[training] {key} = {getattr(training, key)!r}; allowed is {getattr(training, key)!r} (or [validation] "
             "enable = false)"
             for key in ("local_batch_size", "seq_len") if getattr(validation, key) != getattr(training, key)]
    if lines:
        raise ConfigError("\n".join(lines))


def trainer_config(job_config: Any, user_keys: Mapping[str, set[str]]) -> Any:
    """0.3's ``Trainer.Config`` for a parsed TOML (``job_config``: 0.2.2's keys, as parsed;
    ``user_keys``: the ``[commopt.<family>]`` keys set). Raises ConfigError for a value with no 0.3
    counterpart."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from ..tt03 import assets
    from ..tt03.replica_group_trainer import with_fault_tolerance
    from ..tt03.validate import with_global_model_validation
    from .toml_schema import all_keys

    cfg = with_fault_tolerance(llama3_debugmodel())  # [fault_tolerance]: torchtitan's torchft keys
    for section, keys in all_keys().items():
        if section in SECTIONS_GONE:
            continue
        table = job_config
        for part in section.split("."):
            table = getattr(table, part)
        for key in keys:
            if isinstance(key.to, str) and key.to not in (BY_HAND, WIRING):
                _set(cfg, key.to, getattr(table, key.name))
    model, training = job_config.model, job_config.training
    cfg.dump_folder = job_config.job.dump_folder
    cfg.hf_assets_path = (
        str(assets.tokenizer_dir(tokenizer_corpus(training.dataset))) if is_bundled_tokenizer(model.hf_assets_path) else model.hf_assets_path
    )
    cfg.model_spec = model_spec(model.flavor)
    cfg.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(cfg.model_spec)))
    validation = job_config.validation
    cfg.dataloader.dataset, cfg.dataloader.dataset_path = training.dataset.lower(), training.dataset_path
    if validation.enable:
        _same_batches_as_training(validation, training)
    cfg.validator.dataloader.dataset, cfg.validator.dataloader.dataset_path = validation.dataset.lower(), validation.dataset_path
    with_global_model_validation(cfg)  # as on 0.2.2: the global model, for every [model] name
    cfg.activation_checkpoint = _activation_checkpoint(job_config.activation_checkpoint)
    cfg.optimizer = _optimizer(job_config, user_keys)
    if job_config.model.name == COMMOPT_SPEC:
        from ..tt03.configs import with_comm_metrics

        with_comm_metrics(cfg)
    return cfg

