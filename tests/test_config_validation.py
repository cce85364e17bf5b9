"""Bad configs fail before any process group exists, one line each naming key, value and what is
allowed. Table-driven: (optimizer name, TOML lines to add, CLI args, substrings the error must show);
the torchtitan keys, files, sections and command-line forms in a second table further down."""

import re

import pytest

from titan_commopt.options import ConfigError
from titan_commopt.train import check_config

from tests.titan_utils import CONFIG, job_and_resolved, readme_toml

BAD = [
    # [optimizer] name
    ("Adamm", "", [], ["[optimizer] name = 'Adamm'", "AdamW", "Dion"]),
    ("dion", "", [], ["[optimizer] name = 'dion': did you mean 'Dion'?", "allowed is one of"]),
    ("FlexDemo", "", [], ["[optimizer] name = 'FlexDemo': did you mean 'FlexDeMo'?", "allowed is one of AdamW"]),
    ("adamw", "", [], ["[optimizer] name = 'adamw': did you mean 'AdamW'?"]),
    ("", "", [], ["[optimizer] name = ''"]),
    # [commopt] common
    ("AdamW", "[commopt]\non_nonfinite = 'ignore'", [], ["on_nonfinite = 'ignore'", "'skip', 'stop', 'off'"]),
    ("AdamW", "[commopt]\ncheck_replicas_every = -1", [], ["check_replicas_every = -1", ">= 0"]),
    ("AdamW", "[commopt]\ncheck_replicas_every = 2.5", [], ["check_replicas_every = 2.5", "an integer"]),
    ("AdamW", "[commopt]\nhsdp_estimates = 'yes'", [], ["hsdp_estimates = 'yes'", "true or false"]),
    ("AdamW", "[commopt]\ncheck_replica_every = 3", [], ["unknown key 'check_replica_every'", "did you mean 'check_replicas_every'"]),
    ("AdamW", "[commopt]\nbogus = 1", [], ["unknown key 'bogus'", "known:"]),
    ("AdamW", "[commopt.dionn]\nrank = 4", [], ["unknown key 'dionn'", "did you mean 'dion'"]),
    ("AdamW", "[commopt]\nclip_scope = 'mine'", [], ["clip_scope = 'mine'", "'auto', 'replicas', 'replica'"]),
    ("DeMo", "[commopt]\nclip_scope = 'replica'", [],
     ["[commopt] clip_scope = \"replica\" with [optimizer] name = 'DeMo'", "DiLoCo", "SparseLoCo", "\"replicas\""]),
    ("AdamW", "", ["--commopt.clip_scope", "replica"], ["clip_scope = \"replica\" with [optimizer] name = 'AdamW'"]),
    # [commopt.dion]
    ("Dion", "[commopt.dion]\nrank = -4", [], ["[commopt.dion] rank = -4", ">= 0"]),
    ("Dion", "[commopt.dion]\nrank_fraction = 0.0", [], ["rank_fraction = 0.0", "> 0 and <= 1"]),
    ("Dion", "[commopt.dion]\nrank_fraction = 1.5", [], ["rank_fraction = 1.5", "<= 1"]),
    ("Dion", "[commopt.dion]\nmu = 1.0", [], ["mu = 1.0", "< 1"]),
    ("Dion", "[commopt.dion]\northogonalize = 'svd'", [], ["orthogonalize = 'svd'", "'qr', 'cholesky_qr'"]),
    ("Dion", "[commopt.dion]\ncompress = 'sometimes'", [], ["compress = 'sometimes'", "'auto'"]),
    ("Dion", "[commopt.dion]\nscalar_optimizer = 'sgd'", [], ["scalar_optimizer = 'sgd'", "'adamw', 'lion'"]),
    ("Dion", "[commopt.dion]\nscalar_lr_scale = 0", [], ["scalar_lr_scale = 0", "> 0"]),
    ("Dion", "[commopt.dion]\nrnak = 4", [], ["unknown key 'rnak'", "did you mean 'rank'"]),
    ("Dion", "[commopt.dion]\nrank = 'full'", [], ["rank = 'full'", "an integer"]),
    # [commopt.local]
    ("DES-LOC", "[commopt.local]\nbase = 'lamb'", [], ["base = 'lamb'", "'adam', 'adopt', 'sgdm'"]),
    ("DES-LOC", "[commopt.local]\nKx = -1", [], ["Kx = -1", ">= 0"]),
    ("DES-LOC", "[commopt.local]\nKv = 'sometimes'", [], ["Kv = 'sometimes'", '"auto"']),
    ("DES-LOC", "[commopt.local]\nouter = 'adam'", [], ["outer = 'adam'", "'average', 'nesterov'"]),
    ("DES-LOC", "[commopt.local]\nouter_momentum = 1.0", [], ["outer_momentum = 1.0", "< 1"]),
    ("DES-LOC", "[commopt.local]\nclip = 'value'", [], ["clip = 'value'", "'coordinate'"]),
    ("DES-LOC", "[commopt.local]\nclip_threshold = 0.0", [], ["clip_threshold = 0.0", "> 0"]),
    ("DES-LOC", "[commopt.local]\ntransfer_dtype = 'int8'", [], ["transfer_dtype = 'int8'", "'bf16'"]),
    ("MT-DAO", "[commopt.local]\nKu = [32, 64]", [], ["Ku = [32, 64]", "beta1 = [0.999]", "a list of 2 entries"]),
    ("MT-DAO", "[commopt.local]\nomega = [0.7, 0.6]\nKu = [8, 8]\nbeta1 = [0.9, 0.99]", [], ["omega = [0.7, 0.6]", "sum <= 1"]),
    ("DES-LOC", "[commopt.local]\nbeta1 = [1.5]", [], ["beta1 = [1.5]", "[0, 1)"]),
    ("DES-LOC", "[commopt.local]\nkx = 4", [], ["unknown key 'kx'", "did you mean 'Kx'"]),
    ("DiLoCo", "[commopt.local]\nouter_wire_dtype = 'fp2'", [], ["outer_wire_dtype = 'fp2'", "'same', 'fp8', 'fp4'"]),
    ("DiLoCo", "[commopt.local]\nouter_wire_dtype = 'fp4'\nKx = 0", [], ["outer_wire_dtype = 'fp4' with Kx = 0"]),
    # the Muon step's keys, in each table that has them ([commopt.muon], [commopt.local], [commopt.sparseloco])
    ("Muon", "[commopt.muon]\nmuon_dtype = 'fp16'", [], ["[commopt.muon] muon_dtype = 'fp16'", "'bf16', 'fp32'"]),
    ("Muon", "[commopt.muon]\nmuon_momentm = 0.9", [], ["unknown key 'muon_momentm'", "did you mean 'muon_momentum'"]),
    ("Muon", "[commopt.muon]\nscalar_beta1 = 1.5", [], ["[commopt.muon] scalar_beta1 = 1.5", "< 1"]),
    ("MuLoCo", "[commopt.local]\nmuon_ns_steps = 7", [], ["[commopt.local] muon_ns_steps = 7", "allowed is 5"]),
    ("MuLoCo", "", ["--commopt.local.muon_lr_rule", "spectral"],
     ["muon_lr_rule = 'spectral' (from --commopt.local.muon_lr_rule)", "'spectral_norm'"]),
    ("MuLoCo", "[commopt.local]\nswitch_at = 5", [], ["[commopt.local] switch_at = 5", "base = \"muon\" is 0"]),
    ("MuLoCo-2bit", "", ["--commopt.sparseloco.muon_momentum", "1.0"], ["[commopt.sparseloco] muon_momentum = 1.0", "< 1"]),
    ("MuLoCo-2bit", "[commopt.sparseloco]\ninner = 'muonn'", [], ["inner = 'muonn'", "'adamw', 'muon'"]),
    # incompatible combinations with torchtitan settings
    ("Dion", "", ["--optimizer.early_step_in_backward"], ["early_step_in_backward = True", "'Dion'"]),
    ("DES-LOC", "", ["--parallelism.pipeline_parallel_degree", "2"], ["pipeline_parallel_degree = 2", "not supported"]),
    ("Dion", "", ["--training.enable_cpu_offload"], ["enable_cpu_offload = True", "not supported"]),
    ("Dion", "", ["--fault_tolerance.enable", "--fault_tolerance.group_size", "0"],
     ["[fault_tolerance] group_size = 0", "at least 1"]),  # more: tests/test_fault_tolerance_live.py
    # several problems at once: one line each
    ("Dion", "[commopt]\non_nonfinite = 'x'\n[commopt.dion]\nmu = 2.0", [], ["on_nonfinite = 'x'", "mu = 2.0"]),
]


@pytest.mark.parametrize("name,toml,cli,expected", BAD, ids=[f"{i:02d}" for i in range(len(BAD))])
def test_bad_config_is_refused_with_one_line_each(tmp_path, name, toml, cli, expected):
    path = tmp_path / "job.toml"
    base = CONFIG.read_text()
    base = base[: base.index("\n[commopt]")]  # the cases bring their own [commopt] tables
    path.write_text(base + "\n" + toml + "\n")
    with pytest.raises(ConfigError) as info:
        check_config(["--job.config_file", str(path), "--optimizer.name", name, *cli])
    message = str(info.value)
    for piece in expected:
        piece = piece.replace("{tmp}", str(tmp_path))
        assert piece in message, f"{piece!r} not in:\n{message}"
    _one_line_each(message)


def _one_line_each(message: str) -> None:
    for line in message.splitlines():  # every line names a section/key, the command line's option or a variable
        assert line.startswith(("[", "command line: ")) or re.match(r"[A-Z][A-Z0-9_]+ (=|is) ", line), line


def test_at_least_thirty_bad_configs():
    assert len(BAD) >= 30


@pytest.mark.both_lines
def test_good_config_passes(tmp_path):
    job, resolved = job_and_resolved(["--job.config_file", str(CONFIG), "--optimizer.name", "Dion", "--commopt.dion.rank", "8"])
    assert job.commopt.dion.rank == 8 and job.optimizer.name == "Dion"
    assert resolved.options.rank == 8 and resolved.user_set == {"rank"}


@pytest.mark.both_lines
@pytest.mark.parametrize("name, table, cli, key, value", [
    ("FlexDeMo", "[commopt.demo]\nsign_before_sync = false", [], "sign_before_sync", False),
    ("FlexDeMo", "", ["--commopt.demo.no-sign_before_sync"], "sign_before_sync", False),
    ("FlexDeMo", "", ["--commopt.demo.chunk", "64"], "chunk", 64),
    ("MT-DAO", "[commopt.local]\nbase = \"adam\"", [], "base", "adam"),
    ("DES-LOC", "[commopt.local]\nclip = \"none\"", [], "clip", "none"),
    ("DiLoCo", "", ["--commopt.local.outer", "average"], "outer", "average"),
    # each new name, a key its preset sets typed at the family's default (TOML and command line)
    ("Muon", "[commopt.muon]\nmuon_momentum = 0.95", [], "muon_momentum", 0.95),
    ("MuLoCo", "", ["--commopt.local.outer_momentum", "0.9"], "outer_momentum", 0.9),
    ("MuLoCo", "[commopt.local]\nKx = 32", [], "Kx", 32),
    ("MuLoCo-2bit", "[commopt.sparseloco]\nouter_momentum = 0.0", [], "outer_momentum", 0.0),
    ("MuLoCo-2bit", "", ["--commopt.sparseloco.H", "15"], "H", 15),
])
def test_a_key_the_user_sets_beats_the_preset_even_at_the_default(tmp_path, name, table, cli, key, value):
    path = tmp_path / "job.toml"
    base = CONFIG.read_text()
    path.write_text(base[: base.index("\n[commopt]")] + "\n" + table + "\n")
    job, resolved = job_and_resolved(["--job.config_file", str(path), "--optimizer.name", name, *cli])
    assert getattr(resolved.options, key) == value and key in resolved.user_set
    assert key not in resolved.preset_keys()
    others = set(resolved.family.presets[name]) - {key}
    assert others and all(getattr(resolved.options, k) == resolved.family.presets[name][k] for k in others)


# ---- torchtitan keys, files, sections, the command line (titan/config/parse.py, titan/config/torchtitan_keys.py) --
def _config(tmp_path, replace=(), extra="", name="job.toml"):
    text = CONFIG.read_text()
    for old, new in replace:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text + "\n" + extra + "\n")
    return path


def _text_file(tmp_path, content: str):
    path = tmp_path / "corpus.txt"
    path.write_text(content)
    return str(path)


# (TOML replacements, TOML to add, CLI args, world size, substrings of the error); "{tmp}" in a CLI
# arg is the test's tmp_path.
BAD_TORCHTITAN = [
    # [optimizer]: finite and in range (torch.optim's own limits), from the CLI and from the TOML
    ((), "", ["--optimizer.lr", "nan"], None, ["[optimizer] lr = nan", "finite number >= 0"]),
    ((("lr = 3e-3", "lr = -1e-3"),), "", [], None, ["[optimizer] lr = -0.001", ">= 0"]),
    ((), "", ["--optimizer.beta1", "1.5"], None, ["[optimizer] beta1 = 1.5", ">= 0 and < 1"]),
    ((), "", ["--optimizer.beta2", "1.0"], None, ["[optimizer] beta2 = 1.0", "< 1"]),
    ((("eps = 1e-8", "eps = -1e-8"),), "", [], None, ["[optimizer] eps = -1e-08", ">= 0"]),
    ((), "", ["--optimizer.weight_decay", "inf"], None, ["[optimizer] weight_decay = inf", "finite"]),
    ((("lr = 3e-3", 'lr = "fast"'),), "", [], None, ["[optimizer] lr = 'fast'", "a number"]),
    ((("lr = 3e-3", 'lr = 3e-3\nimplementation = "fast"'),), "", [], None, ["implementation = 'fast'", "'foreach'"]),
    # [training], [lr_scheduler], [metrics], [checkpoint]
    ((), "", ["--training.seq_len", "0"], None, ["[training] seq_len = 0", "an integer >= 1"]),
    ((), "", ["--training.local_batch_size", "-2"], None, ["[training] local_batch_size = -2", ">= 1"]),
    ((), "", ["--training.global_batch_size", "0"], None, ["[training] global_batch_size = 0", "-1"]),
    ((), "", ["--training.global_batch_size", "6"], 2, ["global_batch_size = 6", "multiple of", "4 × 2 = 8"]),
    ((), "", ["--training.steps", "0"], None, ["[training] steps = 0", ">= 1"]),
    ((), "", ["--training.max_norm", "-1"], None, ["[training] max_norm = -1", ">= 0"]),
    ((), "", ["--training.gc_freq", "0"], None, ["[training] gc_freq = 0", ">= 1"]),
    ((), "", ["--lr_scheduler.warmup_steps", "-5"], None, ["[lr_scheduler] warmup_steps = -5", ">= 0"]),
    ((), "", ["--lr_scheduler.min_lr_factor", "2"], None, ["[lr_scheduler] min_lr_factor = 2.0", "<= 1"]),
    ((), "", ["--metrics.log_freq", "0"], None, ["[metrics] log_freq = 0", ">= 1"]),
    ((("enable = false", "enable = true"), ("interval = 20", "interval = 0")), "", [], None, ["[checkpoint] interval = 0", ">= 1"]),
    ((("enable = false", "enable = true"),), "", ["--checkpoint.exclude_from_loading", "optimzer"], None,
     ["[checkpoint] exclude_from_loading = ['optimzer']", "a list of: model, optimizer, lr_scheduler"]),
    ((("enable = false", "enable = true"),), "", ["--checkpoint.load_step", "-2"], None,
     ["[checkpoint] load_step = -2", "-1 (the newest checkpoint)"]),
    # mixed precision: a dtype name torch knows by another spelling
    ((('mixed_precision_param = "float32"', 'mixed_precision_param = "bf16"'),), "", [], None,
     ["[training] mixed_precision_param = 'bf16'", "one of 'bfloat16', 'float32'"]),
    ((), "", ["--training.mixed_precision_param", "bf16"], None,
     ["mixed_precision_param = 'bf16' (from --training.mixed_precision_param)", "'bfloat16'"]),
    ((('mixed_precision_param = "float32"', 'mixed_precision_param = "float32"\nmixed_precision_reduce = "bfloat16"'),), "", [], None,
     ["mixed_precision_reduce = 'bfloat16'", "one of 'float32'"]),
    # the model
    ((), "", ["--model.flavor", "9B"], None, ["[model] flavor = '9B'", "cpu_small", "8B"]),
    ((), "", ["--model.name", "llama3", "--optimizer.name", "DeMo"], None,
     ["[model] name = 'llama3' with [optimizer] name = 'DeMo'", "'llama3_commopt'"]),
    ((), "", ["--model.name", "llama3_reference", "--optimizer.name", "Dion"], None, ["[model] name = 'llama3_reference'"]),
    ((), "", ["--model.name", "lama3"], None, ["[model] name = 'lama3'", "llama3_commopt"]),
    # torchtitan's own llama3 spec reads hf_assets_path with its HuggingFace loader
    ((), "", ["--model.name", "llama3", "--model.flavor", "debugmodel", "--model.hf_assets_path", "{tmp}/nope"], None,
     ["[model] hf_assets_path = '{tmp}/nope': no such directory", "tokenizer.json", "(model 'llama3')"]),
    ((), "", ["--model.name", "llama3", "--model.flavor", "debugmodel", "--model.hf_assets_path", "{tmp}"], None,
     ["[model] hf_assets_path = '{tmp}': holds no tokenizer", "(model 'llama3')"]),
    ((), "", ["--model.name", "llama3", "--model.flavor", "debugmodel", "--model.hf_assets_path", "{tmp}/one.txt"], None,
     ["[model] hf_assets_path = '{tmp}/one.txt': not a directory"]),
    # the mesh against WORLD_SIZE (torchrun's, known before any process group)
    ((), "", ["--parallelism.data_parallel_replicate_degree", "3"], 2,
     ["data_parallel_replicate_degree = 3", "must divide WORLD_SIZE = 2"]),
    ((), "", ["--parallelism.data_parallel_shard_degree", "3"], 4,
     ["data_parallel_shard_degree = 3 = 3 processes", "WORLD_SIZE = 4"]),
    ((), "", ["--parallelism.data_parallel_replicate_degree", "0"], 2, ["data_parallel_replicate_degree = 0", ">= 1"]),
    ((), "", ["--parallelism.data_parallel_shard_degree", "0"], None, ["data_parallel_shard_degree = 0", "-1"]),
    # data: the textfile dataset and its file
    ((), "", ["--training.dataset", "textfile"], None, ["[training] dataset = 'textfile' needs dataset_path"]),
    ((), "", ["--training.dataset", "textfile", "--training.dataset_path", "{tmp}/missing.txt"], None,
     ["dataset_path = '", "missing.txt': no such file"]),
    ((), "", ["--training.dataset", "textfile", "--training.dataset_path", "{tmp}"], None, ["is a directory"]),
    ((), "", ["--training.dataset", "textfile", "--training.dataset_path", "{tmp}/empty.txt"], None, ["empty.txt': has no text"]),
    ((), "", ["--training.dataset", "textfile", "--training.dataset_path", "{tmp}/blank.txt"], None, ["blank.txt': has no text"]),
    ((), "", ["--training.dataset", "textfile", "--training.dataset_path", "{tmp}/one.txt",
              "--parallelism.data_parallel_replicate_degree", "2"], 2, ["has 1 non-blank line(s)", "data-parallel degree is 2"]),
    ((), "", ["--training.dataset", "c5"], None, ["[training] dataset = 'c5'", "commopt_tiny", "textfile"]),
    ((), "", ["--training.dataset", "c4_test"], None, ["[training] dataset = 'c4_test': ", "tests/assets/c4_test does not exist"]),
    ((), "", ["--training.dataset", "c4", "--training.dataset_path", "{tmp}/no_c4"], None,
     ["[training] dataset_path = '{tmp}/no_c4': {tmp}/no_c4 does not exist (torchtitan's 'c4' reads it)"]),
    # the output folder
    ((), "", ["--job.dump_folder", "{tmp}/one.txt/out"], None, ["[job] dump_folder = '{tmp}/one.txt/out': {tmp}/one.txt is a file"]),
    ((), "", ["--job.dump_folder", "{tmp}/one.txt"], None, ["[job] dump_folder = '{tmp}/one.txt': is a file"]),
    # the config file
    ((), "", ["--job.config_file", "{tmp}/missing.toml"], None, ["[job] config_file = '", "missing.toml': no such file"]),
    ((), "", ["--job.config_file", "{tmp}"], None, ["is a directory, not a TOML file"]),
    ((), "", ["--job.config_file", "{tmp}/one.txt"], None, ["one.txt': not valid TOML"]),
    # sections and keys: a did-you-mean for ours and torchtitan's
    ((), "[comopt]\nhsdp_estimates = false", [], None, ["[comopt]: unknown section; did you mean [commopt]?"]),
    ((), "[trainig]\nsteps = 3", [], None, ["[trainig]: unknown section; did you mean [training]?"]),
    ((("steps = 40", "stepz = 40"),), "", [], None, ["[training] unknown key 'stepz'; did you mean 'steps'?"]),
    ((), "[commopt.demo]\nchnk = 8", [], None, ["[commopt.demo] unknown key 'chnk'; did you mean 'chunk'?"]),
    ((("[job]", "compile = 1\n[job]"),), "", [], None, ["[compile] = 1: allowed is a table"]),
    # the command line
    ((), "", ["--trainng.steps", "3"], None, ["command line: unknown option '--trainng.steps'; did you mean --training.steps?"]),
    ((), "", ["--commopt.demo.chnk", "8"], None, ["did you mean --commopt.demo.chunk?"]),
    ((), "", ["--training.steps", "ten"], None, ["[training] steps = 'ten' (from --training.steps): allowed is an integer"]),
    ((), "", ["--training.steps"], None, ["[training] steps (from --training.steps): needs a value"]),
    ((), "", ["--commopt.demo.sign_before_sync=maybe"], None, ["sign_before_sync = 'maybe'", "true or false"]),
    # a bad boolean as a separate word names its key (tyro alone says "Unrecognized options: flase")
    ((), "", ["--commopt.demo.sign_before_sync", "flase"], None,
     ["[commopt.demo] sign_before_sync = 'flase' (from --commopt.demo.sign_before_sync): allowed is true or false"]),
    ((), "", ["--checkpoint.enable", "ture", "--training.steps", "3"], None,
     ["[checkpoint] enable = 'ture' (from --checkpoint.enable): allowed is true or false"]),
    ((), "", ["--checkpoint.no-enable", "false"], None,
     ["[checkpoint] enable (from --checkpoint.no-enable false): --checkpoint.no-enable is a flag, it takes no value"]),
    ((), "", ["--commopt.dion.rank", "many"], None, ["[commopt.dion] rank = 'many' (from --commopt.dion.rank): allowed is an integer"]),
    # several at once, across torchtitan's keys and ours
    ((), "[commopt.dion]\nmu = 2.0", ["--optimizer.name", "Dion", "--optimizer.lr", "nan", "--training.seq_len", "0"], None,
     ["lr = nan", "seq_len = 0", "mu = 2.0"]),
]


@pytest.mark.both_lines
@pytest.mark.parametrize("replace,extra,cli,world_size,expected", BAD_TORCHTITAN, ids=[f"t{i:02d}" for i in range(len(BAD_TORCHTITAN))])
def test_bad_torchtitan_setting_is_refused_with_one_line_each(tmp_path, replace, extra, cli, world_size, expected):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n   \n\t\n")
    (tmp_path / "one.txt").write_text("one document\n")
    path = _config(tmp_path, replace, extra)
    cli = [arg.replace("{tmp}", str(tmp_path)) for arg in cli]
    if "--job.config_file" not in cli:
        cli = ["--job.config_file", str(path), *cli]
    with pytest.raises(ConfigError) as info:
        check_config(cli, world_size=world_size)
    message = str(info.value)
    for piece in expected:
        piece = piece.replace("{tmp}", str(tmp_path))
        assert piece in message, f"{piece!r} not in:\n{message}"
    _one_line_each(message)


@pytest.mark.both_lines
@pytest.mark.parametrize("cli, check", [
    # docs/options.md's `--<section>.<key> v` form for booleans, ours and torchtitan's, next to tyro's flags
    (["--commopt.demo.sign_before_sync", "false"], lambda j: j.commopt.demo.sign_before_sync is False),
    (["--commopt.demo.sign_before_sync=False"], lambda j: j.commopt.demo.sign_before_sync is False),
    (["--commopt.demo.sign_before_sync", "true"], lambda j: j.commopt.demo.sign_before_sync is True),
    (["--commopt.demo.sign-before-sync"], lambda j: j.commopt.demo.sign_before_sync is True),
    (["--commopt.hsdp_estimates", "false"], lambda j: j.commopt.hsdp_estimates is False),
    (["--metrics.enable_tensorboard", "false"], lambda j: j.metrics.enable_tensorboard is False),
    (["--checkpoint.enable=true"], lambda j: j.checkpoint.enable is True),
    (["--checkpoint.enable", "true", "--training.steps", "3"], lambda j: j.checkpoint.enable is True and j.training.steps == 3),
    (["--checkpoint.no-enable"], lambda j: j.checkpoint.enable is False),
])
def test_boolean_true_false_on_the_command_line(cli, check):
    job, _ = job_and_resolved(["--job.config_file", str(CONFIG), "--optimizer.name", "FlexDeMo", *cli])
    assert check(job)


@pytest.mark.both_lines
def test_a_boolean_given_as_true_false_counts_as_set():
    # FlexDeMo's preset sets sign_before_sync = True; the user's `false` must win and be recorded as set
    _, resolved = job_and_resolved(["--job.config_file", str(CONFIG), "--optimizer.name", "FlexDeMo",
                                "--commopt.demo.sign_before_sync", "false"])
    assert resolved.options.sign_before_sync is False and "sign_before_sync" in resolved.user_set


@pytest.mark.both_lines
def test_good_world_size_and_textfile_pass(tmp_path):
    corpus = _text_file(tmp_path, "first document\n\nsecond document\n")
    job, _ = job_and_resolved(["--job.config_file", str(CONFIG), "--training.dataset", "textfile", "--training.dataset_path", corpus,
                           "--parallelism.data_parallel_replicate_degree", "2"], world_size=2)
    assert job.training.dataset_path == corpus


@pytest.mark.both_lines
def test_tyro_messages_become_one_line():
    from titan_commopt.titan.config.parse import _squash

    box = ("╭─ Value error ─────────────╮\n│ Error parsing --x.y: bad  │\n│ value 'z'                 │\n"
           "│ ───────────────────────── │\n│ Argument helptext:        │\n╰───────────────────────────╯\n")
    assert _squash(box) == "Error parsing --x.y: bad value 'z'"
    plain = (" Unrecognized options               \n ---------------------------------- \n  Unrecognized options: 4           \n"
             "  ----------------------------------\n  For full helptext, run -c --help  \n                                    \n")
    assert _squash(plain) == "Unrecognized options: 4"


@pytest.mark.both_lines
def test_what_only_tyro_sees_is_one_line_too():
    with pytest.raises(ConfigError) as info:
        check_config(["--job.config_file", str(CONFIG), "--training.steps", "3", "4"])
    assert str(info.value) == "command line: Unrecognized options: 4"


@pytest.mark.both_lines
def test_readme_toml_validates_as_written(tmp_path):
    """The README's example names neither custom_config_module nor custom_import: they are added."""
    toml = readme_toml()
    assert "custom_config_module" not in toml and "custom_import" not in toml
    path = tmp_path / "my.toml"
    path.write_text(toml)
    job, resolved = job_and_resolved(["--job.config_file", str(path)], world_size=2)
    assert job.model.name == "llama3_commopt" and resolved.name == "FlexDeMo" and job.commopt.demo.chunk == 32


@pytest.mark.both_lines
def test_list_options_take_separate_words():  # docs/options.md's `--commopt.local.Ku 16 64`
    _, resolved = job_and_resolved(["--job.config_file", str(CONFIG), "--optimizer.name", "MT-DAO", "--commopt.local.Ku", "16", "64",
                                "--commopt.local.beta1", "0.9", "0.99", "--commopt.local.omega", "0.5", "0.3"])
    assert (resolved.options.Ku, resolved.options.beta1, resolved.options.omega) == ([16, 64], [0.9, 0.99], [0.5, 0.3])
    assert {"Ku", "beta1", "omega"} <= resolved.user_set


@pytest.mark.both_lines
@pytest.mark.parametrize("path, expected", [
    ("{tmp}/nope", "hf_assets_path = '{tmp}/nope': no such file or directory; allowed is \"bundled\""),
    ("{tmp}", "hf_assets_path = '{tmp}': holds no tokenizer"),
])
def test_missing_tokenizer_is_one_line(tmp_path, path, expected):
    path, expected = (x.replace("{tmp}", str(tmp_path)) for x in (path, expected))
    with pytest.raises(ConfigError) as info:
        check_config(["--job.config_file", str(CONFIG), "--model.hf_assets_path", path])
    assert str(info.value).startswith("[model] " + expected) and len(str(info.value).splitlines()) == 1
    _hf_tokenizer(tmp_path)
    if path == str(tmp_path):
        check_config(["--job.config_file", str(CONFIG), "--model.hf_assets_path", path])  # a directory with a tokenizer: passes


def _hf_tokenizer(folder):
    """A directory with a tokenizer.json HuggingFace tokenizers reads (an empty BPE)."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(folder / "tokenizer.json"))
    return folder


# A damaged tokenizer file: (the files, LINE it applies to or None for both, the file named, what it is read as)
DAMAGED_TOKENIZERS = [
    ({"tokenizer.model": "garbage"}, "0.2", "tokenizer.model", "as a SentencePiece model (RuntimeError: "),
    ({"tokenizer.json": "{not json"}, None, "tokenizer.json", "by HuggingFace tokenizers (Exception: "),
    ({"tokenizer.json": None, "tokenizer_config.json": '{"bos_token": '}, None, "tokenizer_config.json",
     "as JSON (JSONDecodeError: Expecting value"),
    ({"tokenizer.json": None, "tokenizer_config.json": "{}", "chat_template.jinja": "{% for x in %}"}, "0.3",
     "chat_template.jinja", "as a Jinja template (TemplateSyntaxError: "),
]


@pytest.mark.both_lines
@pytest.mark.parametrize("files, line, named, read_as", DAMAGED_TOKENIZERS, ids=[d[2] for d in DAMAGED_TOKENIZERS])
def test_a_damaged_tokenizer_file_is_one_line_naming_it(tmp_path, files, line, named, read_as):
    """Each tokenizer file the line's loader reads is read before any process group: a damaged one is
    one line naming it (not the tokenizer library's traceback on every rank)."""
    from tests.titan_utils import LINE

    if line is not None and line != LINE:
        pytest.skip(f"torchtitan {line} reads {named}")
    for name, text in files.items():
        _hf_tokenizer(tmp_path) if text is None else (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as info:
        check_config(["--job.config_file", str(CONFIG), "--model.hf_assets_path", str(tmp_path)])
    (problem,) = str(info.value).splitlines()
    assert problem.startswith(f"[model] hf_assets_path = '{tmp_path}': {tmp_path / named} cannot be read {read_as}"), problem
    if LINE == "0.2":  # a SentencePiece .model file named directly
        (tmp_path / "own.model").write_text("garbage")
        with pytest.raises(ConfigError) as info:
            check_config(["--job.config_file", str(CONFIG), "--model.hf_assets_path", str(tmp_path / "own.model")])
        assert str(info.value).startswith(f"[model] hf_assets_path = '{tmp_path / 'own.model'}': the file cannot be "
                                          "read as a SentencePiece model"), info.value


def test_user_set_keys_counts_every_accepted_form():
    from titan_commopt.titan.config.sources import user_set_keys

    for argv in (["--commopt.demo.sign_before_sync", "false"], ["--commopt.demo.sign_before_sync=false"],
                 ["--commopt.demo.no-sign_before_sync"], ["--commopt.demo.no_sign_before_sync"],
                 ["--commopt.demo.sign-before-sync"], ["--commopt.demo.no-sign-before-sync"]):
        assert user_set_keys(argv, {})["demo"] == {"sign_before_sync"}, argv


# ---- warnings: valid, but probably not meant (titan/config/validate.py: run_warnings) -------------
def _warnings(tmp_path, cli, table=""):
    base = CONFIG.read_text()
    path = tmp_path / "job.toml"
    path.write_text(base[: base.index("\n[commopt]")] + "\n" + table + "\n")
    return check_config(["--job.config_file", str(path), *cli]).warnings


@pytest.mark.both_lines
@pytest.mark.parametrize("cli, table, expected", [
    # the A/B case: one TOML, the optimizer switched on the command line
    (["--optimizer.name", "Dion", "--commopt.demo.chunk", "32"], "",
     ["[commopt.demo] chunk: set, but [optimizer] name = 'Dion' reads [commopt.dion]; ignored "
      "([commopt.demo] is read by DeMo, FlexDeMo)"]),
    (["--optimizer.name", "Dion"], "[commopt.demo]\nchunk = 32\nsign_before_sync = false\n[commopt.dion]\nrank = 8",
     ["[commopt.demo] chunk, sign_before_sync: set, but [optimizer] name = 'Dion' reads [commopt.dion]"]),
    (["--optimizer.name", "AdamW"], "[commopt.demo]\nchunk = 32\n[commopt.local]\nKx = 4",
     ["[commopt.demo] chunk: set, but [optimizer] name = 'AdamW' reads no [commopt.<family>] table",
      "[commopt.local] Kx: set, but [optimizer] name = 'AdamW' reads no [commopt.<family>] table"]),
    (["--optimizer.name", "FlexDeMo", "--commopt.demo.chunk", "32"], "[commopt]\nhsdp_estimates = false", []),
    (["--optimizer.name", "DES-LOC"], "[commopt.demo]", []),  # an empty table sets nothing
])
def test_a_table_the_optimizer_does_not_read_gets_one_warning_line(tmp_path, cli, table, expected):
    found = _warnings(tmp_path, cli, table)
    assert len(found) == len(expected), found
    for line, piece in zip(found, expected):
        assert line.startswith(piece), (line, piece)


@pytest.mark.both_lines
def test_an_unread_table_is_still_checked(tmp_path):
    with pytest.raises(ConfigError) as info:
        _warnings(tmp_path, ["--optimizer.name", "Dion"], "[commopt.demo]\nchunk = -1")
    assert str(info.value).startswith("[commopt.demo] chunk = -1")


def test_the_readme_toml_with_another_optimizer_warns_about_its_demo_table(tmp_path):
    path = tmp_path / "my.toml"
    path.write_text(readme_toml())
    run = check_config(["--job.config_file", str(path), "--optimizer.name", "DES-LOC"], world_size=2)
    assert [line.split(":")[0] for line in run.warnings] == ["[commopt.demo] chunk"]


@pytest.mark.both_lines
@pytest.mark.parametrize("cli, warned", [
    (["--optimizer.name", "MT-DAO"], "from the MT-DAO preset"),  # debug_cpu.toml: 40 steps, warm-up 5
    (["--optimizer.name", "MT-DAO-halflife"], "from the MT-DAO-halflife preset"),
    (["--optimizer.name", "DES-LOC", "--commopt.local.switch_at", "warmup"], "as set"),
    (["--optimizer.name", "MT-DAO", "--training.steps", "{short}"], "from the MT-DAO preset"),
    (["--optimizer.name", "MT-DAO", "--training.steps", "{long}"], None),  # long enough
    (["--optimizer.name", "MT-DAO", "--commopt.local.switch_at", "0"], None),  # the README's advice
    (["--optimizer.name", "MT-DAO", "--lr_scheduler.warmup_steps", "0"], None),  # no warm-up: no switch
    (["--optimizer.name", "MT-DAO", "--lr_scheduler.warmup_steps", "40"], None),  # never reached in 40 steps
    (["--optimizer.name", "DES-LOC"], None),
])
def test_mt_dao_switch_in_a_short_run_gets_one_warning_line(tmp_path, cli, warned):
    from titan_commopt.titan.config.validate import SWITCH_MIN_STEPS

    cli = [arg.format(short=SWITCH_MIN_STEPS - 1, long=SWITCH_MIN_STEPS) for arg in cli]
    run = check_config(["--job.config_file", str(_config(tmp_path)), *cli])
    if warned is None:
        assert run.warnings == []
        return
    (line,) = run.warnings
    steps, warmup = run.job_config.training.steps, run.job_config.lr_scheduler.warmup_steps
    assert line == (
        f"[commopt.local] switch_at = 'warmup' ({warned}) with [training] steps = {steps}: the switch at the end "
        f"of warm-up (step {warmup}) is meant for runs of at least {SWITCH_MIN_STEPS} steps (after a short "
        "warm-up the carried momentum misleads training for hundreds of steps); set [commopt.local] switch_at = 0 "
        "(--commopt.local.switch_at 0)"
    )


def _main_without_training(monkeypatch, argv):
    """``titan_commopt.train.main`` up to where torchtitan would start."""
    import titan_commopt.titan.tt022.trainer as trainer
    import titan_commopt.titan.platform.console as console
    import titan_commopt.titan.platform.cpu as cpu
    from titan_commopt.train import main

    started = []
    monkeypatch.setattr(trainer, "run_torchtitan", started.append)
    monkeypatch.setattr(console, "quiet_known_noise", lambda: None)
    monkeypatch.setattr(cpu, "use_cpu_if_no_accelerator", lambda: None)
    main(argv)
    assert len(started) == 1


def test_warnings_are_printed_once_by_rank_0_or_by_the_launcher(monkeypatch, capsys):
    from titan_commopt.train import WARNED_ENV, WARNING_PREFIX, report_warnings

    argv = ["--job.config_file", str(CONFIG), "--optimizer.name", "Dion", "--commopt.demo.chunk", "32"]
    warning = WARNING_PREFIX + "[commopt.demo] chunk: set, but [optimizer] name = 'Dion' reads [commopt.dion]"
    monkeypatch.setenv(WARNED_ENV, "")  # unset (and restored after the test: the launcher sets it below)
    # plain torchrun: global rank 0 prints, the others do not
    for rank, copies in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        _main_without_training(monkeypatch, argv)
        err = capsys.readouterr().err
        assert err.count(warning) == copies and err.count(WARNING_PREFIX) == copies, err
    # titan_commopt.run prints them before any worker starts; its workers, rank 0 included, do not
    run = check_config(argv)
    capsys.readouterr()
    report_warnings(run, launcher=True)
    assert capsys.readouterr().err.count(warning) == 1
    monkeypatch.setenv("RANK", "0")
    _main_without_training(monkeypatch, argv)  # the worker inherits the launcher's environment
    assert WARNING_PREFIX not in capsys.readouterr().err


# ---- [checkpoint] load_step: the checkpoint it names, before any process group ----
@pytest.mark.both_lines
def test_a_load_step_naming_no_checkpoint_is_one_line_before_any_process_group(tmp_path, monkeypatch):
    """``--checkpoint.load_step`` (0 too: torchtitan's own FileNotFoundError) naming no complete
    checkpoint, or given with checkpointing off (torchtitan would ignore it): the resume check's line,
    from the config check (in the launcher, before any worker); under fault tolerance the group's own
    folder's."""
    (tmp_path / "checkpoint" / "step-2").mkdir(parents=True)  # a save that did not finish: no .metadata
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    folder = tmp_path / "checkpoint"
    on = ["--checkpoint.enable", "true"]
    for args, expected in [
        ([*on, "--checkpoint.load_step", "0"], f"[checkpoint] load_step = 0: {folder} has no step-0; complete "
                                               "checkpoints: none (load_step = -1: the newest)"),
        ([*on, "--checkpoint.load_step", "2"], f"[checkpoint] load_step = 2: {folder}/step-2 has no .metadata"),
        (["--checkpoint.load_step", "7"], "[checkpoint] load_step = 7 with [checkpoint] enable = false: nothing is "
                                          "loaded; allowed is [checkpoint] enable = true to resume from it"),
        ([*on, "--checkpoint.load_step", "2", "--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
          "--fault_tolerance.replica_id", "1"], f"[checkpoint] load_step = 2: {folder}/replica_1 does not exist"),
    ]:
        with pytest.raises(ConfigError) as info:
            check_config(["--job.config_file", str(CONFIG), "--job.dump_folder", str(tmp_path), *args], world_size=2)
        (line,) = str(info.value).splitlines()
        assert line.startswith(expected), line
    check_config(["--job.config_file", str(CONFIG), "--job.dump_folder", str(tmp_path), *on], world_size=2)  # the newest
    # a first run (no checkpoint folder yet) loads initial_load_path: it must be a directory
    first = ["--job.config_file", str(CONFIG), "--job.dump_folder", str(tmp_path / "first"), *on]
    with pytest.raises(ConfigError) as info:
        check_config([*first, "--checkpoint.initial_load_path", str(tmp_path / "seed")], world_size=2)
    (line,) = str(info.value).splitlines()
    assert line.startswith(f"[checkpoint] initial_load_path = '{tmp_path / 'seed'}': no such directory; allowed is a "
                           "checkpoint directory, which torchtitan loads on a first run"), line
    check_config([*first, "--checkpoint.initial_load_path", str(folder)], world_size=2)
