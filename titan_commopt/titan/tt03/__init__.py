"""torchtitan 0.3, its own ways of running: a config module, ``@override``, its command line.

- ``container.py``: ``CommOptimizers``, torchtitan 0.3's optimizer container for our optimizers, and
  its ``Config`` (the optimizer's name and the ``[commopt]`` options as typed fields);
- ``configs.py``: our config module (``--module titan_commopt.titan.tt03.configs --config cpu_debugmodel``),
  ``commopt_optimizer`` and ``apply_cpu_fixes`` for config modules of your own;
- ``overrides.py``: ``@override`` functions for ``--override.imports`` (our optimizer in any config; our metrics);
- ``preflight.py``: ``CommOptTrainer``, the Trainer of our config functions, which checks the whole
  config (overrides on a copy, mesh, backend, tokenizer, data) before the process group;
- ``replica_group_trainer.py``: ``ReplicaGroupTrainer``, live fault tolerance on torchft (torchtitan's
  own ``--fault_tolerance.*`` keys), the Trainer ``CommOptTrainer`` and our TOML runner's derive from;
- ``fsdp.py``: the ``fully_shard`` wrapper (R left to our optimizers; SUM on gloo); ``building.py``:
  the Trainer being built, which the wrapper and the container read (its optimizer and checkpoint
  settings: not its fault tolerance, which the Trainer hands the container in its config);
- ``cpu.py``, ``assets.py``, ``metrics.py``: the CPU fixes, the offline tokenizer and dataset, ``comm/*``
  in TensorBoard.
"""
