"""Put on PYTHONPATH by tests/test_healing_runs.py: lets accelerate apply its FSDP plugin to CPU processes.

accelerate turns an FSDP config into FSDP only for accelerator processes (its CPU processes train with DDP), so a
machine without GPUs cannot otherwise run the FSDP code path. With this gate lifted, FSDP2 shards the model over
gloo processes exactly as it does over NCCL ones: every parameter a DTensor shard, checkpoints written and read by
accelerate's FSDP functions. Only the backend differs from a GPU run."""

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
