"""The local-step families: every replica steps on its own gradient and syncs R every few steps.

- ``adaptive.py``: DES-LOC / MT-DAO (also LocalAdam, DiLoCo, MuLoCo), ``[commopt.local]``, with ``sync.py`` (its
  sync schedule and the two ways a sync lands) and ``update.py`` (its local step in torch) beside
  ``update_triton.py`` (the same step as one Triton kernel);
- ``sparseloco.py``: SparseLoCo (and MuLoCo-2bit), ``[commopt.sparseloco]``;
- ``steps.py``: what both share (the step prologue, the counter, the chunked multi-tensor update).
"""
