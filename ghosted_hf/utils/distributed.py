"""The one distributed layer of calibration and healing: every wait for peers bounded by one timeout and failing
with one line. Healing's Trainer (accelerate) adopts the group joined here; on CUDA it joins it itself, with the same
timeout and failure (`rendezvous`)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator, Mapping

import torch

from ..errors import GhostedError

logger = logging.getLogger(__name__)

# How long a process waits for its peers (rendezvous and every collective) before it fails with a message;
# GHOSTED_DISTRIBUTED_TIMEOUT (seconds) overrides it for very long passes.
DEFAULT_TIMEOUT_S = 1800
WAIT_NOTICE_S = 10.0  # a rendezvous longer than this says what it waits for, and for how long
# (rank, world size, local rank) as torchrun (and accelerate's GPU launcher) or an MPI launcher (accelerate's
# multi-CPU launcher runs mpirun: Open MPI, MPICH / Intel MPI, MVAPICH) describe them.
LAUNCHER_VARIABLES = (("RANK", "WORLD_SIZE", "LOCAL_RANK"),
                      ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                      ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
                      ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"))


def timeout_s() -> float:
    """How long to wait for peers: GHOSTED_DISTRIBUTED_TIMEOUT seconds, else `DEFAULT_TIMEOUT_S`."""
    return float(os.environ.get("GHOSTED_DISTRIBUTED_TIMEOUT", DEFAULT_TIMEOUT_S))


def launcher_process(environ: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world size, local rank) that the launcher gave this process; (0, 1, 0) when none did."""
    environ = os.environ if environ is None else environ
    for names in LAUNCHER_VARIABLES:
        if environ.get(names[1]):
            values = [environ.get(name, "0").strip() for name in names]
            if not (all(v.isdigit() for v in values) and 0 <= int(values[0]) < int(values[1])):
                given = ", ".join(f"{name}={value!r}" for name, value in zip(names, values))
                raise GhostedError(f"The launcher's environment is inconsistent ({given}): rank, world size and local "
                                   "rank must be integers with 0 <= rank < world size; start the processes with "
                                   "torchrun or accelerate launch.")
            rank, world, local = map(int, values)
            return rank, world, local
    return 0, 1, 0


def init_distributed() -> bool:
    """Join the process group the launcher describes (NCCL with CUDA, gloo otherwise); True with several processes."""
    import torch.distributed as dist

    if not dist.is_available():
        return False
    if dist.is_initialized():
        return dist.get_world_size() > 1
    rank, world, local_rank = launcher_process()
    if world <= 1:
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise GhostedError(f"Process {rank} of {world}: MASTER_ADDR and MASTER_PORT are not set, so the processes cannot "
                           "find each other; start them with torchrun or accelerate launch (which set them).")
    logger.info("Joining process group: rank %d of %d (%s, timeout %.0f s).", rank, world, backend, timeout_s())
    with rendezvous():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s()))
    return True


@contextlib.contextmanager
def rendezvous() -> Iterator[None]:
    """Around whatever joins the launcher's group (here, or accelerate under the Trainer): peers that do not all
    come within the timeout fail this process with one line naming the address and the timeout."""
    import threading

    import torch.distributed as dist

    rank, world, _ = launcher_process()
    waiting = threading.Timer(min(WAIT_NOTICE_S, timeout_s() / 2), lambda: logger.warning(
        "Process %d of %d: waiting for the other processes at %s:%s (up to %.0f s; GHOSTED_DISTRIBUTED_TIMEOUT sets "
        "it).", rank, world, os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), timeout_s()))
    waiting.daemon = True
    if world > 1:  # (healing's options pass through here in one process too)
        waiting.start()
    try:
        yield
    # The process that hosts the store times out waiting for the others (DistStoreError), the others connecting to
    # it (DistNetworkError); any other error is not a failed rendezvous.
    except (dist.DistStoreError, dist.DistNetworkError, TimeoutError) as error:
        if world <= 1 or dist.is_initialized():  # not a failed rendezvous
            raise
        raise GhostedError(f"Process {rank} of {world} found no peers at {os.environ.get('MASTER_ADDR')}:"
                           f"{os.environ.get('MASTER_PORT')} within {timeout_s():.0f} s "
                           f"({str(error).splitlines()[0][:200]}): start every process (torchrun --nproc-per-node N), "
                           "or raise GHOSTED_DISTRIBUTED_TIMEOUT.") from None
    finally:
        waiting.cancel()


def process_rank() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without torch.distributed."""
    import torch.distributed as dist

    if init_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    """Only the main process (rank 0) writes files."""
    return process_rank()[0] == 0


def leave_process_group(completed: bool) -> None:
    """End of a command. After success every process waits for the others (the main one may still be writing)
    before any leaves: a launcher ends all processes once one exits abnormally, so a peer that crashed in its own
    teardown would take the main process's write down with it. gloo's barrier also waits for every collective issued
    before it: one still running in gloo's threads while the interpreter shuts down can abort the process. After a
    failure no wait: peers may never arrive."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if completed and dist.get_world_size() > 1:
            dist.barrier()
    except RuntimeError as error:  # a peer failed (it says why itself) or never came within the timeout
        logger.error("Process %d of %d finished, but its peers did not: %s", dist.get_rank(), dist.get_world_size(),
                     str(error).splitlines()[0][:200])
    finally:
        dist.destroy_process_group()


def check_agreement(claims: Mapping[str, str]) -> None:
    """Before any work: every process must run the same model, data and options (their hashes in `claims`).
    A process that differs fails every process with one line naming it and what differs."""
    import torch.distributed as dist

    rank, world = process_rank()
    if world == 1:
        return
    gathered: list[dict[str, str] | None] = [None] * world
    try:
        dist.all_gather_object(gathered, dict(claims))
    except (RuntimeError, TimeoutError) as error:  # a peer stopped before it got here, or never answered
        raise GhostedError(f"Process {rank} of {world}: the other processes did not report their model, data and "
                           f"options within {timeout_s():.0f} s ({str(error).splitlines()[0][:200]}); see their "
                           "errors, or raise GHOSTED_DISTRIBUTED_TIMEOUT.") from None
    for other, theirs in enumerate(gathered):
        differing = sorted(k for k in set(gathered[0]) | set(theirs) if gathered[0].get(k) != theirs.get(k))
        if differing:
            raise GhostedError(f"Process {other} of {world} has another {', '.join(differing)} than process 0 "
                               f"(this is process {rank}): start every process with the same model, data and "
                               "options.")


def all_reduce_sums(tensors: Mapping[str, torch.Tensor], tokens: int) -> tuple[dict[str, torch.Tensor], int]:
    """The sums of every process (and their token counts); every process gets the same sums."""
    import torch.distributed as dist

    if process_rank()[1] == 1:
        return dict(tensors), tokens
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    count = torch.tensor([tokens], dtype=torch.float64, device=device)
    dist.all_reduce(count)
    summed = {}
    for key in sorted(tensors):  # the same order on every process
        buffer = tensors[key].to(device=device, dtype=torch.float64).contiguous()
        dist.all_reduce(buffer)
        summed[key] = buffer.to(tensors[key].device)
    return summed, int(count.item())
