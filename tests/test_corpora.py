"""The bundled corpora: deterministic, and commopt_world's facts never contradict each other; the
tokenizers trained on them, and the set-up that builds the one the installed torchtitan line reads."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titan_commopt import corpora
from titan_commopt.titan.line import installed_version, line_of

ROOT = Path(__file__).resolve().parents[1]


def test_generators_are_deterministic():
    assert corpora.world(n_docs=50) == corpora.world(n_docs=50)
    assert corpora.tiny(n_docs=50) == corpora.tiny(n_docs=50)
    assert corpora.world(n_docs=50, seed=1) != corpora.world(n_docs=50)


def test_world_facts_are_consistent():
    docs = corpora.world(n_docs=400)
    home, trade, age = {}, {}, {}
    for doc in docs:
        for name, tr, town in re.findall(r"(\w+) is a (\w+) from (\w+)\.", doc):
            assert home.setdefault(name, town) == town and trade.setdefault(name, tr) == tr
        for name, years in re.findall(r"How old is (\w+)\? \w+ is (\d+)\.", doc):
            assert age.setdefault(name, years) == years
        for name, town in re.findall(r"Where does (\w+) live\? \w+ lives in (\w+)\.", doc):
            assert home.setdefault(name, town) == town
    assert len(home) > 50 and len(age) > 20  # the checks above saw many people


def test_world_arithmetic_holds():
    roads = {}
    for doc in corpora.world(n_docs=400):
        for trip in re.findall(r"set out from \w+\.(.*?)So (\w+) walked (\d+) miles in all", doc):
            legs = [int(m) for m in re.findall(r"(\d+) miles", trip[0])]
            assert sum(legs) == int(trip[2])
        for a, b, miles in re.findall(r"The road from (\w+) to (\w+) is (\d+) miles\.", doc):
            assert roads.setdefault(frozenset((a, b)), miles) == miles
        for price, n, cost in re.findall(r"costs (\d+) coins, so (\d+) of [\w ]+ cost (\d+) coins", doc):
            assert int(price) * int(n) == int(cost)
    assert roads


def test_bundled_tokenizer_follows_the_dataset():
    from types import SimpleNamespace

    from titan_commopt.titan.tt022 import tokenizer as sentencepiece

    def tokenizer(dataset):
        return sentencepiece.build_tokenizer(SimpleNamespace(model=SimpleNamespace(hf_assets_path="bundled"),
                                                    training=SimpleNamespace(dataset=dataset)))

    text = " ".join(corpora.world(n_docs=20))
    world, tiny, other = tokenizer("commopt_world"), tokenizer("commopt_tiny"), tokenizer("c4")
    assert len(world.encode(text)) < 0.8 * len(tiny.encode(text))  # trained on this text: fewer pieces
    assert other.encode(text) == tiny.encode(text)  # not a bundled corpus: the default tokenizer


# What each line's training reads from the cache: 0.2.2 the SentencePiece model of the bundled corpus,
# 0.3 (config module and our TOML alike) the HuggingFace BPE tokenizer and the corpus as a JSON dataset.
BUILT_BY_SETUP = {
    "0.2": ("0.2.2", ["commopt_tiny_v1.txt", "spm_commopt_tiny_v1_1024.model"]),
    "0.3": ("*", ["commopt_tiny_v1.txt", "hf_tokenizer_commopt_tiny_v1_2000", "json_dataset_commopt_tiny_v1"]),
}


@pytest.mark.both_lines
def test_setup_builds_what_the_installed_line_reads(tmp_path):
    """``scripts/setup.sh``'s last step, for the installed line, in an empty cache."""
    branch, expected = BUILT_BY_SETUP[line_of(installed_version())]
    script = (ROOT / "scripts" / "setup.sh").read_text()
    build = re.search(rf'^  {re.escape(branch)}\) BUILD="(.*)" ;;$', script, re.M).group(1)
    proc = subprocess.run([sys.executable, "-c", f"import titan_commopt.titan; {build}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TITAN_COMMOPT_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock") == expected


def _facts(docs):
    """{person: (trade, home town)} as the documents state them."""
    out = {}
    for doc in docs:
        for name, trade, town in re.findall(r"(\w+) is a (\w+) from (\w+)\.", doc):
            out.setdefault(name, (trade, town))
    return out


def test_held_out_text_is_never_training_text_and_tells_the_same_world():
    """Each training corpus has its held-out twin: no document of it occurs in the training corpus, and
    the world's facts are the training corpus's (else the held-out loss would measure another world)."""
    from titan_commopt.titan.common.data import corpus_path, read_lines

    assert set(corpora.HELD_OUT) == {"commopt_tiny", "commopt_world"}
    for corpus, heldout in corpora.HELD_OUT.items():
        training, held = read_lines(corpus_path(corpus)), read_lines(corpus_path(heldout))
        assert len(held) == len(set(held)) and not set(held) & set(training), heldout
    world, held = _facts(read_lines(corpus_path("commopt_world"))), _facts(read_lines(corpus_path("commopt_world_heldout")))
    assert len(held) > 100 and all(world[name] == fact for name, fact in held.items())


def test_world_is_long_enough_that_the_study_reads_no_document_twice():
    """cpu_tiny (237,888 parameters on 0.2.2) at 20 tokens per parameter, twice over (a time-to-loss
    budget), fits in the corpus on any data-parallel degree that splits it into equal shards."""
    from types import SimpleNamespace

    from titan_commopt.titan.common.data import corpus_path, read_lines
    from titan_commopt.titan.tt022 import tokenizer as sentencepiece

    docs = read_lines(corpus_path("commopt_world"))
    sp = sentencepiece.build_tokenizer(SimpleNamespace(model=SimpleNamespace(hf_assets_path="bundled"),
                                                       training=SimpleNamespace(dataset="commopt_world")))
    sample = docs[:: len(docs) // 400]
    tokens = len(docs) * sum(len(sp.encode(d)) for d in sample) / len(sample)
    assert tokens > 2 * 20 * 237_888 * 1.1, tokens


def test_a_held_out_corpus_is_refused_as_training_data():
    from types import SimpleNamespace

    from titan_commopt.titan.common.data import register_datasets, text_dataset_problems

    register_datasets()
    job = SimpleNamespace(training=SimpleNamespace(dataset="commopt_world_heldout", dataset_path=None),
                          validation=SimpleNamespace(enable=False))
    assert text_dataset_problems(job, 4) == [
        "[training] dataset = 'commopt_world_heldout': held-out text is never trained on; allowed is a training "
        "corpus (commopt_tiny, commopt_world), with 'commopt_world_heldout' as [validation] dataset"]
    job.training.dataset = "commopt_world"
    assert text_dataset_problems(job, 4) == []
