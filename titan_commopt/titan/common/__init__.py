"""What both torchtitan lines run the same way.

- ``container.py`` (+ ``safeguards.py``, ``clipping.py``, ``replica_checkpoint.py``,
  ``replica_state.py``): torchtitan's optimizer container around our optimizers: a training step's
  rules, bytes and scalars, and each replica's checkpoint state;
- ``build.py``: what the container is made of, in one order (``optimizers.py``: our optimizers per
  model part, FSDP2's byte estimates; ``mesh.py``: the one place meshes become R/S/T);
- ``metrics.py``: what a log step adds to torchtitan's metrics processor; ``main.py``: torchtitan's
  ``main()`` once the config is made;
- ``model.py``, ``data.py``: our llama3 names and flavors, the bundled corpora and datasets;
- ``patch.py``: replacing a torchtitan function once.
"""
