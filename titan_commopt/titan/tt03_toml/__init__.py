"""Our 0.2.2 TOML on torchtitan 0.3: ``python -m titan_commopt.train --job.config_file X.toml`` when 0.3 is
installed. ``toml_schema.py``: torchtitan 0.2.2's keys and where each goes in 0.3; ``toml_config.py``:
the TOML parsed and checked, then 0.3's ``Trainer.Config`` made from it; ``runner.py``: 0.3's Trainer
trains it."""
