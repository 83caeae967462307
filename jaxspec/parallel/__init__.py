"""Device meshes: the target tensor/data parallel, the draft on its own slice, the two-batch pipeline."""

from jaxspec.parallel.mesh import MeshConfig
from jaxspec.parallel.sharding import RULES, param_shardings, place_params

__all__ = ["MeshConfig", "RULES", "param_shardings", "place_params"]
