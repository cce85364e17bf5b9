"""The one place a torchtitan run's meshes become R/S/T, for both lines.

Mesh dim names by line and backend (torchtitan 0.2.2; 0.3's ``partial_dtensor``; 0.3's
``full_dtensor``): R is ``dp_replicate`` in all three; S is ``fsdp`` (0.2.2 and partial_dtensor:
already the flattened ``dp_shard × cp``) or ``dp_shard`` × ``cp`` (full_dtensor keeps them apart,
flattened here into one group); T is ``tp``. :func:`topology_of` reads any object with
``get_optional_mesh(name)`` for those four names: 0.2.2's and 0.3's ``ParallelDims`` directly, or
:class:`ParameterMeshes`, which answers from a parameter's own mesh plus the R mesh FSDP was kept
off (0.3's optimizer container is built from the model parts alone, without ``ParallelDims``).
"""

import dataclasses
from typing import Any, Optional

from torch.distributed.device_mesh import DeviceMesh

from titan_commopt.topology import Topology

__all__ = ["topology_of", "ParameterMeshes"]

_SHARD_DIMS = ("dp_shard", "cp")  # full_dtensor's S, kept apart on the parameters' mesh


def topology_of(meshes: Any, ft: Any = None) -> Topology:
    """R/S/T of a run. torchtitan divides the loss by the global token count, so a replica's
    gradient is ``1/W`` of its mean gradient: ``grad_scale = W`` (``Topology.from_parallel_dims``).

    Under fault tolerance (``ft``: ``common/replica_group.ReplicaGroupFT``) the meshes are one
    replica group's: R is the Manager's group over the quorum (W and the replica index read per
    quorum), and the token count spans the group only, so ``p.grad`` is already the replica's mean
    gradient (``grad_scale = 1``)."""
    topology = Topology.from_parallel_dims(meshes, sums_over_replicas=True)
    if ft is None:
        return topology
    return dataclasses.replace(topology, replicate=ft.replicate, quorum=ft.quorum, grad_scale=1.0)


class ParameterMeshes:
    """``get_optional_mesh`` over a parameter's mesh (S and T dims, any of the names above) and the
    replicate mesh FSDP was kept off (``None``: R is the parameter mesh's ``dp_replicate``, where
    torchtitan's HSDP syncs it, or one replica). Dims of size 1 are absent, as in ``ParallelDims``."""

    def __init__(self, param_mesh: Optional[DeviceMesh], replicate: Optional[DeviceMesh]) -> None:
        self._mesh = param_mesh
        self._replicate = replicate
        self._names = tuple((param_mesh.mesh_dim_names or ()) if param_mesh is not None else ())
        self._shard: Optional[DeviceMesh] = None  # flattened once: the same S mesh on every call

    def _dim(self, name: str) -> Optional[DeviceMesh]:
        if name not in self._names or self._mesh[name].size() == 1:
            return None
        return self._mesh[name]

    def get_optional_mesh(self, name: str) -> Optional[DeviceMesh]:
        if name == "dp_replicate" and self._replicate is not None:
            return self._replicate if self._replicate.size() > 1 else None
        if name == "fsdp" and "fsdp" not in self._names:
            present = tuple(n for n in _SHARD_DIMS if self._dim(n) is not None)
            if not present:
                return None
            if self._shard is None:
                self._shard = self._mesh[present[0]] if len(present) == 1 else self._mesh[present]._flatten("_commopt_S")
            return self._shard
        return self._dim(name)
