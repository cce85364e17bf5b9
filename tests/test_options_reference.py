import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import options_reference  # noqa: E402


def test_docs_options_is_up_to_date():
    assert options_reference.OUT.read_text() == options_reference.render(), (
        "docs/options.md is stale: run .venv/bin/python scripts/options_reference.py --write"
    )
