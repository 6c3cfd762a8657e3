"""Put on PYTHONPATH by tests/test_healing_runs.py: lets accelerate apply its FSDP plugin to CPU processes (and spares
DeepSpeed's CPU processes a kernel compile, below).

accelerate turns an FSDP config into FSDP only for accelerator processes (its CPU processes train with DDP), so a
machine without GPUs cannot otherwise run the FSDP code path. With this gate lifted, FSDP2 shards the model over
gloo processes exactly as it does over NCCL ones: every parameter a DTensor shard, checkpoints written and read by
accelerate's FSDP functions. Only the backend differs from a GPU run."""

import importlib.abc
import importlib.machinery
import sys

import accelerate.state as state
from accelerate.utils import DistributedType

_init = state.AcceleratorState.__init__


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin
        # every later AcceleratorState() copies the process state's type over its own
        state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP


state.AcceleratorState.__init__ = _init_with_fsdp_on_cpu


class _WithoutSharedMemoryKernel(importlib.abc.MetaPathFinder):
    """DeepSpeed on CPU compiles a shared-memory all-reduce kernel when its process group starts (35 s on 2 cores);
    the test checks the sharded model, which gloo's all-reduce gives as well: `deepspeed.comm.torch` is loaded with its
    kernel builder answering that there is none, as on a platform it does not support."""

    def find_spec(self, name, path, target=None):
        if name != "deepspeed.comm.torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                module.build_shm_op = lambda: None
            spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _WithoutSharedMemoryKernel())
