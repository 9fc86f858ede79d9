"""fxtron.core: what the compiler and the runtime share -- the node.meta contract and trace
info, placements per mesh axis, the shard arithmetic, mesh views, stage and local-parameter
descriptions, the run-time records keyed by tensor (records.py). Imports nothing of fxtron but `fxtron.errors` and `fxtron.mesh`, which belong
to this layer too."""
