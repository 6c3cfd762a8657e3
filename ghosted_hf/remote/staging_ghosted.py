"""All-or-nothing folder writes for `save_pretrained`: a whole folder written beside its target that replaces it only
once complete, and scratch paths tagged with their owner so that a later write can clean up what a killed process
left. Copied next to the weights with the model code; standard library only."""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

# What `save_pretrained` writes; files of an earlier save matching these never survive into a new one.
MODEL_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "config.json",
               "generation_config.json", "*.py")


def process_tag() -> str:
    """Who made a scratch path: the host and process, so that a later write can tell a leftover of a killed process
    from the work of a running one."""
    return f"{socket.gethostname()}~{os.getpid()}"


def process_gone(owner: str) -> bool:
    """Whether the process a `process_tag` names has ended (only ever true for a process of this host)."""
    host, _, pid = owner.rpartition("~")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another machine's (a shared disk), or not ours: never touched
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def scratch_folder(parent: Path, stem: str) -> Path:
    """A new folder `parent/<stem><host>~<pid>-XXXX`, readable as any folder the caller makes (the umask's
    permissions, not mkdtemp's 0700: the folder becomes the saved model). Leftovers of `stem` whose process is
    gone are removed first."""
    parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(parent, stem)
    path = Path(tempfile.mkdtemp(dir=parent, prefix=f"{stem}{process_tag()}-"))
    os.chmod(path, 0o777 & ~_umask())
    return path


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def readable_as_made(folder: Path) -> None:
    """Give what a save wrote the permissions a file the caller makes gets (safetensors writes its files 0600 and
    mkdtemp makes 0700 folders; a serving container or another user must be able to read a saved model)."""
    umask = _umask()
    for root, folders, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o666 & ~umask)


def remove_leftovers(parent: Path, stem: str, restore_to: Path | None = None) -> None:
    """Remove what a killed process left under `parent` with `stem` (its owner tag names a process of this host that
    is gone), and say so. With `restore_to` missing, a leftover is the previous folder a kill caught between its two
    renames: it is moved back instead of removed."""
    for entry in sorted(parent.glob(glob.escape(stem) + "*")):
        if not process_gone(entry.name[len(stem):].rpartition("-")[0]):
            continue
        if restore_to is not None and not os.path.lexists(restore_to):
            os.rename(entry, restore_to)
            logger.warning("Restored %s from %s, which a killed save left.", restore_to, entry.name)
            continue
        # with the scratch paths of a save into it (a model saved into a staging folder stages beside it)
        for item in (entry, *parent.glob(f".{glob.escape(entry.name)}.*")):
            if item.is_dir() and not item.is_symlink():
                shutil.rmtree(item, ignore_errors=True)
            else:
                item.unlink(missing_ok=True)
            logger.warning("Removed %s, left by a killed process.", item)


def replace_folder(staging: Path, target: Path) -> None:
    """Move the complete folder `staging` to `target`. The previous `target` is renamed aside first and removed
    only once the new folder is in place, so it is never partly overwritten."""
    backup = None
    if target.exists():
        backup = scratch_folder(target.parent, f".{target.name}.previous-")
        os.rmdir(backup)
        os.rename(target, backup)
    try:
        os.rename(staging, target)
    except BaseException:
        if backup is not None:
            os.rename(backup, target)
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(target: Path) -> Iterator[Path]:
    """Yield an empty sibling folder of `target` to write a whole folder into; on success it replaces `target`, on
    any error it is removed and `target` is left as it was. A symlinked `target` is written where it points (the
    link keeps naming the saved folder); leftovers of killed saves to `target` are cleaned up first."""
    target = target.resolve() if target.is_symlink() else target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target.parent, f".{target.name}.previous-", restore_to=target)
    staging = scratch_folder(target.parent, f".{target.name}.saving-")
    try:
        yield staging
        readable_as_made(staging)
        replace_folder(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def carry_over(folder: Path, staging: Path) -> None:
    """Copy the files of `folder` that a model save does not write (tokenizer, card, ...) into `staging`."""
    for item in folder.iterdir():
        if any(fnmatch.fnmatch(item.name, pattern) for pattern in MODEL_FILES):
            continue
        if item.is_dir():
            shutil.copytree(item, staging / item.name)
        else:
            shutil.copy2(item, staging / item.name)
