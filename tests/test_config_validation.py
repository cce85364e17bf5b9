"""Bad configs fail before any process group exists, one line each naming key, value and what is
allowed. Table-driven: (optimizer name, TOML lines to add, CLI args, substrings the error must show)."""

import pytest

from titan_commopt.options import ConfigError
from titan_commopt.train import check_config
from tests.titan_utils import CONFIG

BAD = [
    # [optimizer] name
    ("Adamm", "", [], ["[optimizer] name = 'Adamm'", "AdamW", "Dion"]),
    ("dion", "", [], ["[optimizer] name = 'dion'", "Dion"]),
    ("", "", [], ["[optimizer] name = ''"]),
    # [commopt] common
    ("AdamW", "[commopt]\non_nonfinite = 'ignore'", [], ["on_nonfinite = 'ignore'", "'skip', 'stop', 'off'"]),
    ("AdamW", "[commopt]\ncheck_replicas_every = -1", [], ["check_replicas_every = -1", ">= 0"]),
    ("AdamW", "[commopt]\ncheck_replicas_every = 2.5", [], ["check_replicas_every = 2.5", "an integer"]),
    ("AdamW", "[commopt]\nhsdp_estimates = 'yes'", [], ["hsdp_estimates = 'yes'", "true or false"]),
    ("AdamW", "[commopt]\ncheck_replica_every = 3", [], ["unknown key 'check_replica_every'", "did you mean 'check_replicas_every'"]),
    ("AdamW", "[commopt]\nbogus = 1", [], ["unknown key 'bogus'", "known:"]),
    ("AdamW", "[commopt.dionn]\nrank = 4", [], ["unknown key 'dionn'", "did you mean 'dion'"]),
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
    # incompatible combinations with torchtitan settings
    ("Dion", "", ["--optimizer.early_step_in_backward"], ["early_step_in_backward = True", "'Dion'"]),
    ("DES-LOC", "", ["--parallelism.pipeline_parallel_degree", "2"], ["pipeline_parallel_degree = 2", "not supported"]),
    ("Dion", "", ["--training.enable_cpu_offload"], ["enable_cpu_offload = True", "not supported"]),
    ("Dion", "", ["--fault_tolerance.enable"], ["[fault_tolerance] enable = True", "torchft"]),
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
        assert piece in message, f"{piece!r} not in:\n{message}"
    for line in message.splitlines():  # every line names a section/key
        assert line.startswith("["), line


def test_at_least_thirty_bad_configs():
    assert len(BAD) >= 30


def test_good_config_passes(tmp_path):
    job, resolved = check_config(["--job.config_file", str(CONFIG), "--optimizer.name", "Dion", "--commopt.dion.rank", "8"])
    assert job.commopt.dion.rank == 8 and job.optimizer.name == "Dion"
    assert resolved.options.rank == 8 and resolved.user_set == {"rank"}


@pytest.mark.parametrize("name, table, cli, key, value", [
    ("FlexDeMo", "[commopt.demo]\nsign_before_sync = false", [], "sign_before_sync", False),
    ("FlexDeMo", "", ["--commopt.demo.no-sign_before_sync"], "sign_before_sync", False),
    ("FlexDeMo", "", ["--commopt.demo.chunk", "64"], "chunk", 64),
    ("MT-DAO", "[commopt.local]\nbase = \"adam\"", [], "base", "adam"),
    ("DES-LOC", "[commopt.local]\nclip = \"none\"", [], "clip", "none"),
    ("DiLoCo", "", ["--commopt.local.outer", "average"], "outer", "average"),
])
def test_a_key_the_user_sets_beats_the_preset_even_at_the_default(tmp_path, name, table, cli, key, value):
    path = tmp_path / "job.toml"
    base = CONFIG.read_text()
    path.write_text(base[: base.index("\n[commopt]")] + "\n" + table + "\n")
    job, resolved = check_config(["--job.config_file", str(path), "--optimizer.name", name, *cli])
    assert getattr(resolved.options, key) == value and key in resolved.user_set
    assert key not in resolved.preset_keys()
    others = set(resolved.family.presets[name]) - {key}
    assert others and all(getattr(resolved.options, k) == resolved.family.presets[name][k] for k in others)
