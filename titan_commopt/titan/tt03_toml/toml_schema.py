"""torchtitan 0.2.2's TOML on torchtitan 0.3: the sections and keys a 0.2.2 ``--job.config_file``
could hold, each with its 0.2.2 type and default and where it goes in 0.3's ``Trainer.Config``.

0.3 reads no TOML, and 0.2.2's ``JobConfig`` is not installed beside it, so the keys are written
down here (torchtitan 0.2.2's ``torchtitan/config/job_config.py``, quantize excepted). Each key is
one :class:`Key`: its 0.2.2 annotation and default (what an absent key meant on 0.2.2, and so what
it means here), and its target:

- a dotted path into ``Trainer.Config`` (``"training.steps"``): the value is set there;
- :data:`BY_HAND`: ``toml_config.py`` maps it (model, optimizer, dataset, activation checkpointing);
- :data:`WIRING`: how 0.2.2 found the plug-in (``custom_config_module``, ``custom_import``,
  ``config_file``): our own values are accepted, another is refused with :class:`Gone`'s reason;
- :class:`Gone`: no 0.3 counterpart; setting it (TOML or command line) is one line, exit status 2.

:func:`schema_class` turns the table into dataclasses (``[commopt]`` included) that tyro parses
exactly as torchtitan 0.2.2's ConfigManager did: the TOML as defaults, ``--section.key value`` on top.
"""

from dataclasses import dataclass, field, make_dataclass
from typing import Any, Literal, Optional, Union

__all__ = ["Key", "Gone", "BY_HAND", "WIRING", "SCHEMA", "SECTIONS_GONE", "ONLY_03", "all_keys", "schema_class", "key_of"]


@dataclass(frozen=True)
class Gone:
    """A 0.2.2 key with no counterpart in torchtitan 0.3: why, and what to do instead."""

    why: str


BY_HAND = "by hand"  # mapped by toml_config.py, not by a path
WIRING = "wiring"  # how torchtitan 0.2.2 found the plug-in: nothing to do on 0.3


@dataclass(frozen=True)
class Key:
    name: str
    type: Any  # torchtitan 0.2.2's annotation
    default: Any  # torchtitan 0.2.2's default
    to: Union[str, Gone]  # a dotted path in Trainer.Config, BY_HAND, WIRING, or Gone


_FT_DATALOADER = Gone(
    "torchtitan 0.3's CheckpointManager has no such key; under [fault_tolerance] each replica group checkpoints "
    "its whole state, its dataloader's too, into its own folder (<folder>/replica_<replica_id>)")
_CONVERTERS = Gone(
    "torchtitan 0.3 applies model converters (float8, mx) in the model registry "
    "(model_registry(flavor, converters=[...])); use a config module (--module ... --config ...)"
)
_PP_EP = "torchtitan 0.3's ParallelismConfig has no such setting"

SCHEMA: dict[str, tuple[Key, ...]] = {
    "job": (
        Key("config_file", Optional[str], None, WIRING),
        Key("dump_folder", str, "./outputs", "dump_folder"),
        Key("description", str, "default job", BY_HAND),  # a label: logged at start
        Key("print_config", bool, False, "debug.print_config"),
        Key("save_config_file", Optional[str], None, "debug.save_config_file"),
        Key("custom_config_module", str, "", WIRING),
    ),
    "profiling": (
        Key("enable_profiling", bool, False, "profiler.enable_profiling"),
        Key("save_traces_folder", str, "profile_traces", "profiler.save_traces_folder"),
        Key("profile_freq", int, 10, "profiler.profile_freq"),
        Key("profiler_active", int, 1, "profiler.profiler_active"),
        Key("profiler_warmup", int, 3, "profiler.profiler_warmup"),
        Key("enable_memory_snapshot", bool, False, "profiler.enable_memory_snapshot"),
        Key("save_memory_snapshot_folder", str, "memory_snapshot", "profiler.save_memory_snapshot_folder"),
    ),
    "metrics": (
        Key("log_freq", int, 10, "metrics.log_freq"),
        Key("enable_tensorboard", bool, False, "metrics.enable_tensorboard"),
        Key("disable_color_printing", bool, False, "metrics.disable_color_printing"),
        Key("save_tb_folder", str, "tb", "metrics.save_tb_folder"),
        Key("save_for_all_ranks", bool, False, "metrics.save_for_all_ranks"),
        Key("enable_wandb", bool, False, "metrics.enable_wandb"),
    ),
    "model": (
        Key("name", str, "llama3", BY_HAND),
        Key("flavor", str, "debugmodel", BY_HAND),
        Key("hf_assets_path", str, "./tests/assets/tokenizer", BY_HAND),
        Key("tokenizer_path", Optional[str], None, Gone(
            "deprecated in torchtitan 0.2.2 and gone in 0.3: 0.3 reads tokenizer.json from [model] hf_assets_path")),
        Key("converters", list[str], [], _CONVERTERS),
        Key("print_after_conversion", bool, False, _CONVERTERS),
    ),
    "optimizer": (
        Key("name", str, "AdamW", BY_HAND),
        Key("lr", float, 0.0008, BY_HAND),
        Key("beta1", float, 0.9, BY_HAND),
        Key("beta2", float, 0.95, BY_HAND),
        Key("eps", float, 1e-08, BY_HAND),
        Key("weight_decay", float, 0.1, BY_HAND),
        Key("implementation", Literal["for-loop", "foreach", "fused"], "fused", "optimizer.implementation"),
        Key("early_step_in_backward", bool, False, Gone(
            "torchtitan 0.3's OptimizersContainer has no optimizer step inside backward")),
    ),
    "lr_scheduler": (
        Key("warmup_steps", int, 200, "lr_scheduler.warmup_steps"),
        Key("total_steps", Optional[int], None, "lr_scheduler.total_steps"),
        Key("decay_ratio", Optional[float], None, "lr_scheduler.decay_ratio"),
        Key("decay_type", Literal["linear", "sqrt", "cosine"], "linear", "lr_scheduler.decay_type"),
        Key("min_lr_factor", float, 0.0, "lr_scheduler.min_lr_factor"),
    ),
    "training": (
        Key("dataset", str, "c4_test", BY_HAND),
        Key("dataset_path", Optional[str], None, BY_HAND),
        Key("local_batch_size", int, 8, "training.local_batch_size"),
        Key("global_batch_size", int, -1, "training.global_batch_size"),
        Key("seq_len", int, 2048, "training.seq_len"),
        Key("max_norm", Union[float, int], 1.0, "training.max_norm"),
        Key("steps", int, 10000, "training.steps"),
        Key("enable_cpu_offload", bool, False, "training.enable_cpu_offload"),
        Key("dtype", Literal["bfloat16", "float32"], "float32", "training.dtype"),
        Key("mixed_precision_param", Literal["bfloat16", "float32"], "bfloat16", "training.mixed_precision_param"),
        Key("mixed_precision_reduce", Literal["float32"], "float32", "training.mixed_precision_reduce"),
        Key("gc_freq", int, 50, "training.gc_freq"),
        Key("gc_debug", bool, False, "training.gc_debug"),
    ),
    "training.dataloader": (
        Key("num_workers", int, 0, "dataloader.num_workers"),
        Key("persistent_workers", bool, False, "dataloader.persistent_workers"),
        Key("pin_memory", bool, False, "dataloader.pin_memory"),
        Key("prefetch_factor", Optional[int], None, "dataloader.prefetch_factor"),
    ),
    "parallelism": (
        Key("data_parallel_replicate_degree", int, 1, "parallelism.data_parallel_replicate_degree"),
        Key("data_parallel_shard_degree", int, -1, "parallelism.data_parallel_shard_degree"),
        Key("fsdp_reshard_after_forward", Literal["default", "always", "never"], "default",
            "parallelism.fsdp_reshard_after_forward"),
        Key("tensor_parallel_degree", int, 1, "parallelism.tensor_parallel_degree"),
        Key("disable_loss_parallel", bool, False, Gone(
            "torchtitan 0.3 has no switch for loss parallelism (it follows enable_sequence_parallel)")),
        Key("enable_async_tensor_parallel", bool, False, "compile.enable_async_tensor_parallel"),
        Key("pipeline_parallel_degree", int, 1, "parallelism.pipeline_parallel_degree"),
        Key("module_fqns_per_model_part", Optional[list[list[str]]], None, "parallelism.module_fqns_per_model_part"),
        Key("pipeline_parallel_first_stage_less_layers", int, 1, "parallelism.pipeline_parallel_first_stage_less_layers"),
        Key("pipeline_parallel_last_stage_less_layers", int, 1, "parallelism.pipeline_parallel_last_stage_less_layers"),
        Key("pipeline_parallel_layers_per_stage", Optional[int], None, "parallelism.pipeline_parallel_layers_per_stage"),
        Key("pipeline_parallel_schedule", str, "1F1B", "parallelism.pipeline_parallel_schedule"),
        Key("pipeline_parallel_schedule_csv", Optional[str], "", "parallelism.pipeline_parallel_schedule_csv"),
        Key("pipeline_parallel_microbatch_size", int, 1, "parallelism.pipeline_parallel_microbatch_size"),
        Key("pipeline_parallel_expert_parallel_overlap", bool, True, Gone(_PP_EP)),
        Key("context_parallel_degree", int, 1, "parallelism.context_parallel_degree"),
        Key("context_parallel_load_balancer", Optional[str], "headtail", "parallelism.context_parallel_load_balancer"),
        Key("context_parallel_rotate_method", Literal["allgather", "alltoall"], "allgather", Gone(_PP_EP)),
        Key("expert_parallel_degree", int, 1, "parallelism.expert_parallel_degree"),
        Key("expert_tensor_parallel_degree", int, 1, Gone(_PP_EP)),
        Key("expert_parallel_comm_backend", Literal["standard", "deepep"], "standard", Gone(_PP_EP)),
    ),
    "checkpoint": (
        Key("enable", bool, False, "checkpoint.enable"),
        Key("enable_ft_dataloader_checkpoints", bool, True, _FT_DATALOADER),
        Key("folder", str, "checkpoint", "checkpoint.folder"),
        Key("interval", int, 500, "checkpoint.interval"),
        Key("initial_load_path", Optional[str], None, "checkpoint.initial_load_path"),
        Key("initial_load_model_only", bool, True, "checkpoint.initial_load_model_only"),
        Key("initial_load_in_hf", bool, False, "checkpoint.initial_load_in_hf"),
        Key("initial_load_in_hf_quantized", bool, False, "checkpoint.initial_load_in_hf_quantized"),
        Key("last_save_model_only", bool, True, "checkpoint.last_save_model_only"),
        Key("last_save_in_hf", bool, False, "checkpoint.last_save_in_hf"),
        Key("export_dtype", Literal["float16", "bfloat16", "float32"], "float32", "checkpoint.export_dtype"),
        Key("async_mode", Literal["disabled", "async", "async_with_pinned_mem"], "disabled", "checkpoint.async_mode"),
        Key("keep_latest_k", int, 10, "checkpoint.keep_latest_k"),
        Key("load_step", int, -1, "checkpoint.load_step"),
        Key("exclude_from_loading", list[str], [], "checkpoint.exclude_from_loading"),
        Key("enable_first_step_checkpoint", bool, False, "checkpoint.enable_first_step_checkpoint"),
        Key("create_seed_checkpoint", bool, False, "checkpoint.create_seed_checkpoint"),
        Key("load_only", bool, False, "checkpoint.load_only"),
    ),
    "activation_checkpoint": (
        Key("mode", Literal["selective", "full", "memory_budget", "none"], "selective", BY_HAND),
        Key("selective_ac_option", str, "2", BY_HAND),
        Key("per_op_sac_force_recompute_mm_shapes_by_fqns", list[str], ["moe.router.gate"], BY_HAND),
        Key("early_stop", bool, False, Gone("torchtitan 0.3's activation checkpointing has no early stop")),
        Key("memory_budget", float, 0.5, BY_HAND),
        Key("visualize_memory_budget_pareto", bool, False, BY_HAND),
        Key("preserve_rng_state", bool, True, BY_HAND),
        Key("determinism_check", str, "default", BY_HAND),
        Key("debug", bool, False, BY_HAND),
    ),
    "compile": (
        Key("enable", bool, False, "compile.enable"),
        Key("components", list[str], ["model", "loss"], "compile.components"),
        Key("backend", str, "inductor", "compile.backend"),
    ),
    "quantize": (),  # converters: the whole section is _CONVERTERS (see SECTIONS_GONE)
    "comm": (
        Key("init_timeout_seconds", int, 300, "comm.init_timeout_seconds"),
        Key("train_timeout_seconds", int, 100, "comm.train_timeout_seconds"),
        Key("trace_buf_size", int, 20000, "comm.trace_buf_size"),
        Key("save_traces_folder", str, "comm_traces", "comm.save_traces_folder"),
        Key("save_traces_file_prefix", str, "rank_", "comm.save_traces_file_prefix"),
        Key("mode", Literal["default", "fake_backend", "local_tensor"], "default", "comm.mode"),
    ),
    "memory_estimation": (
        Key("enable", bool, False, Gone("torchtitan 0.3 has no memory estimation mode")),
        Key("disable_fake_mode", bool, False, Gone("torchtitan 0.3 has no memory estimation mode")),
    ),
    "fault_tolerance": (  # torchtitan 0.3's torchft experiment spells them alike (TorchFTManager.Config)
        Key("enable", bool, False, "fault_tolerance.enable"),
        Key("process_group", str, "gloo", "fault_tolerance.process_group"),
        Key("process_group_timeout_ms", int, 10000, "fault_tolerance.process_group_timeout_ms"),
        Key("replica_id", int, 0, "fault_tolerance.replica_id"),
        Key("group_size", int, 0, "fault_tolerance.group_size"),
        Key("min_replica_size", int, 1, "fault_tolerance.min_replica_size"),
        Key("semi_sync_method", Optional[str], None, "fault_tolerance.semi_sync_method"),
    ),
    "experimental": (
        Key("custom_import", str, "", WIRING),
        Key("custom_args_module", str, "", Gone(
            "torchtitan 0.3 has no custom args module: its config is a Python function (--module ... --config ...)")),
    ),
    "validation": (
        Key("enable", bool, False, "validator.enable"),
        Key("dataset", str, "c4_validation", BY_HAND),
        Key("dataset_path", Optional[str], None, BY_HAND),
        # torchtitan 0.3's validator reads batches of [training]'s shape: the same values only (toml_config.py)
        Key("local_batch_size", int, 8, BY_HAND),
        Key("seq_len", int, 2048, BY_HAND),
        Key("freq", int, 10, "validator.freq"),
        Key("steps", int, -1, "validator.steps"),
    ),
    "validation.dataloader": (
        Key("num_workers", int, 0, "validator.dataloader.num_workers"),
        Key("persistent_workers", bool, False, "validator.dataloader.persistent_workers"),
        Key("pin_memory", bool, False, "validator.dataloader.pin_memory"),
        Key("prefetch_factor", Optional[int], None, "validator.dataloader.prefetch_factor"),
    ),
    "debug": (
        Key("seed", Optional[int], None, "debug.seed"),
        Key("deterministic", bool, False, "debug.deterministic"),
        Key("deterministic_warn_only", bool, False, "debug.deterministic_warn_only"),
        Key("moe_force_load_balance", bool, False, "debug.moe_force_load_balance"),
    ),
}

# Sections whose every key is gone on 0.3 (torchtitan 0.2.2's nested [quantize.linear.float8] etc.)
SECTIONS_GONE = {"quantize": _CONVERTERS}

# Keys a TOML may set on 0.3 only (0.2.2 had none of them): (section, Key). The default of
# spmd_backend is what 0.2.2 did (FSDP2 and TP on DTensors), not 0.3's spmd_types (which
# fully_shard refused with more than one process on torch 2.13).
ONLY_03: tuple[tuple[str, Key], ...] = (
    ("parallelism", Key("spmd_backend", Literal["partial_dtensor", "full_dtensor", "spmd_types"], "partial_dtensor",
                        "parallelism.spmd_backend")),
)


def all_keys() -> dict[str, tuple[Key, ...]]:
    """Every section's keys: :data:`SCHEMA` plus :data:`ONLY_03`."""
    out = {section: tuple(keys) for section, keys in SCHEMA.items()}
    for section, key in ONLY_03:
        out[section] = out[section] + (key,)
    return out


def key_of(dotted: str) -> Optional[Key]:
    """The :class:`Key` of ``section.key`` (``training.dataloader.num_workers`` too), or None."""
    section, _, name = dotted.rpartition(".")
    return next((k for k in all_keys().get(section, ()) if k.name == name), None)


def _default(value: Any) -> Any:
    return field(default_factory=lambda: list(value)) if isinstance(value, list) else field(default=value)


def _section_class(section: str, keys: dict[str, tuple[Key, ...]]) -> type:
    own = [(k.name, k.type, _default(k.default)) for k in keys[section]]
    children = [
        (child.rpartition(".")[2], cls, field(default_factory=cls))
        for child in keys if child.rpartition(".")[0] == section
        for cls in [_section_class(child, keys)]
    ]
    return make_dataclass("".join(p.title() for p in section.replace("_", ".").split(".")), own + children)


def schema_class() -> type:
    """torchtitan 0.2.2's JobConfig as written in :data:`SCHEMA` (plus :data:`ONLY_03`), with our
    ``[commopt]`` section: what the TOML and the command line are checked and parsed against."""
    from titan_commopt.titan.config.section import CommOpt

    keys = all_keys()
    top = [s for s in keys if "." not in s and s not in SECTIONS_GONE]
    sections = [(s, cls, field(default_factory=cls)) for s in top for cls in [_section_class(s, keys)]]
    return make_dataclass("JobConfig02", sections + [("commopt", CommOpt, field(default_factory=CommOpt))])
