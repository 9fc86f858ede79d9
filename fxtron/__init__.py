"""fxtron: Megatron-style distributed training by compilation on torch.fx.

    mesh = fxtron.Mesh(world_size=4)                        # dp = 4
    pm = fxtron.parallelize(model, mesh, example_inputs=(tokens, targets))
    print(pm.summary()); print(pm.graph(rank=3))
    fxtron.launch(train, mesh, args=(...))                  # or torchrun + fxtron.init_distributed(mesh)

    mesh = fxtron.Mesh(world_size=8, tp=2, pp=2)            # dp = 2
    pm = fxtron.parallelize(model, mesh, example_inputs=..., microbatches=8, schedule="1f1b")
    pm = fxtron.parallelize(model, mesh, example_inputs=..., config=fxtron.Config(...))   # the same, typed
    print(pm.stages())                                      # which layers each stage runs

    @fxtron.register_rule(torch.ops.aten.cumsum.default)   # an op fxtron has no sharding rule for
    def cumsum(ctx): ...                                    # see fxtron.passes.rules.registry

The package's layers and where each piece lives: fxtron/README.md.
"""
import fxtron.codegen  # noqa: F401 - the kernels the ops call (fxtron.ops.kernels)
from fxtron.api import ParallelModel, parallelize
from fxtron.config import Config
from fxtron.core.placement import PARTIAL, REPLICATE, Partial, Replicate, Shard
from fxtron.errors import CompileError, LaunchError, ParallelizeError, ParallelizeWarning, PeerError, RefusalError
from fxtron.mesh import Mesh
from fxtron.passes.rules import register_rule
from fxtron.runtime.batch import Microbatches
from fxtron.runtime.checkpoint.dcp import load_full_state_dict
from fxtron.runtime.groups import ProcessGroups, init_distributed
from fxtron.runtime.launch import launch
from fxtron.runtime.optim import optimizer_reads
from fxtron.trainer.config import TrainConfig

__all__ = ["Config", "TrainConfig", "Mesh", "ParallelModel", "ParallelizeError", "ParallelizeWarning", "LaunchError", "PeerError", "RefusalError", "CompileError", "ProcessGroups",
           "init_distributed", "launch", "parallelize", "Microbatches", "load_full_state_dict",
           "register_rule", "optimizer_reads", "Replicate", "Shard", "Partial", "REPLICATE", "PARTIAL"]
