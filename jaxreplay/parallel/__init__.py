"""Mesh construction and partition rules (parameters by path, batches on the data axes)."""

from jaxreplay.parallel.sharding import (BATCH_AXES, MESH_AXES, PARAM_RULES, batch_sharding,
                                         fit_spec, make_mesh, make_sharded_array,
                                         param_shardings, path_str, shard_batch, shard_params,
                                         spec_for)

__all__ = ["BATCH_AXES", "MESH_AXES", "PARAM_RULES", "batch_sharding", "fit_spec", "make_mesh",
           "make_sharded_array", "param_shardings", "path_str", "shard_batch", "shard_params",
           "spec_for"]
