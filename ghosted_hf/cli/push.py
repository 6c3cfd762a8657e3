"""`ghosted push`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..options import from_namespace, option


@dataclass(kw_only=True)
class PushArgs:
    """Arguments of `ghosted push`."""

    folder: str = option(help="Saved ghosted model folder (with its card).")
    repo_id: str = option(help="Hub repository, e.g. you/my-ghosted-model.")
    private: bool = option(False, "Create the repository as private.")
    revision: str | None = option(None, "Branch to push to (created if needed).")
    timeout: float = option(60.0, "Seconds to wait for an answer from the Hub before giving up with an error.")


def cmd_push(args: argparse.Namespace) -> int:
    """`ghosted push`: verify a saved folder and upload it to the Hub."""
    from ..io.hub import push_to_hub

    run = from_namespace(PushArgs, args)
    pushed = push_to_hub(run.folder, run.repo_id, private=run.private, revision=run.revision, timeout=run.timeout)
    print(f"Pushed {run.folder} to {run.repo_id} in commit {pushed.commit} ({pushed.commit_url})")
    print(f'Load it with AutoModelForCausalLM.from_pretrained("{run.repo_id}", revision="{pushed.commit}", '
          "trust_remote_code=True)")
    return 0
