"""Every shipped TOML parses through torchtitan's ConfigManager and passes our [commopt] validation
with no config warning (no process group, no model): a typo in a config users copy fails here, not on
their cluster."""

from pathlib import Path

import pytest
import tomli

from titan_commopt.options import ConfigError

from titan_commopt.train import check_config


CONFIGS = sorted((Path(__file__).resolve().parents[1] / "train_configs").glob("*.toml"))


def test_configs_found():
    assert any(p.name.startswith("llama3_8b_") for p in CONFIGS) and any(p.name == "debug_cpu.toml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_validates(path):
    args = ["--job.config_file", str(path)]
    toml = tomli.loads(path.read_text())
    tokenizer = toml["model"]["hf_assets_path"]
    if tokenizer != "bundled" and not Path(tokenizer).exists():
        # the 8B configs name the llama3 tokenizer users download: not here, and the only complaint
        with pytest.raises(ConfigError) as info:
            check_config(args)
        assert str(info.value).startswith(f"[model] hf_assets_path = {tokenizer!r}: no such file or directory")
        assert len(str(info.value).splitlines()) == 1
        args += ["--model.hf_assets_path", "bundled"]
    run = check_config(args)
    job = run.job_config
    assert job.model.name == "llama3_commopt"
    # each runs its optimizer as the README recommends for its length (MT-DAO's switch) and reads
    # every [commopt.<family>] table it sets: no config warning
    assert run.warnings == []
    if path.stem.startswith("llama3_8b_"):
        # the file's optimizer is the one its name says, on the 2 x 8 mesh docs/multinode.md describes
        assert job.optimizer.name.lower().replace("-", "_") == path.stem.removeprefix("llama3_8b_")
        assert (job.parallelism.data_parallel_replicate_degree, job.parallelism.data_parallel_shard_degree) == (2, 8)
        assert job.model.flavor == "8B"
        # docs/multinode.md: TensorBoard under outputs/llama3_8b_<[optimizer] name>/tb
        assert (job.job.dump_folder, job.metrics.save_tb_folder) == (f"./outputs/llama3_8b_{job.optimizer.name}", "tb")
        assert job.metrics.enable_tensorboard


def test_every_family_ships_a_cpu_and_an_8b_config_in_the_multinode_guide():
    """A registered family (a built-in one: FAMILY_MODULES) has a CPU config and an 8B config that run
    one of its names, and docs/multinode.md lists that 8B config."""
    from titan_commopt.optim import FAMILIES, family_of, owns_replicate_sync

    guide = (Path(__file__).resolve().parents[1] / "docs" / "multinode.md").read_text()
    runs: dict[str, set[str]] = {}
    for path in CONFIGS:
        name = tomli.loads(path.read_text())["optimizer"]["name"]
        if owns_replicate_sync(name):
            runs.setdefault(family_of(name).key, set()).add(path.stem)
    for key in FAMILIES:
        stems = runs.get(key, set())
        assert any(s.endswith("_cpu") for s in stems), f"no train_configs/*_cpu.toml runs [commopt.{key}]"
        big = sorted(s for s in stems if s.startswith("llama3_8b_"))
        assert big, f"no train_configs/llama3_8b_*.toml runs [commopt.{key}]"
        for stem in big:
            assert f"`{stem.removeprefix('llama3_8b_')}`" in guide, f"docs/multinode.md does not list {stem}.toml"
