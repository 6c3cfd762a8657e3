"""A small local HTTP server that speaks the part of the Hub API huggingface_hub uses to create a repo,
read a file and upload a folder (regular, non-LFS uploads), so that the real client can be tested offline.
It binds 127.0.0.1 only and stores what arrives in memory."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(self, token: str = "hf_test_token") -> None:
        self.token = token
        self.repos: dict[str, dict] = {}  # repo_id -> {"private": bool, "branches": {name: {path: bytes}}, "commits": [...]}
        self.requests: list[tuple[str, str]] = []
        self.validated: list[dict] = []  # README metadata checked by /api/validate-yaml
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, body: dict | bytes | None = None, headers: dict | None = None) -> None:
                data = body if isinstance(body, bytes) else json.dumps(body or {}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json" if not isinstance(body, bytes) else "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def _authorized(self) -> bool:
                return self.headers.get("Authorization") == f"Bearer {hub.token}"

            def do_HEAD(self):
                self.do_GET()

            def do_GET(self):
                hub.requests.append((self.command, self.path))
                path = unquote(urlparse(self.path).path)
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "whoami-v2"]:
                    return self._send(200, {"name": "tester", "type": "user", "auth": {"accessToken": {"role": "write"}}})
                if parts[:2] == ["api", "models"] and "revision" in parts:
                    i = parts.index("revision")
                    repo, branch = "/".join(parts[2:i]), "/".join(parts[i + 1:])
                    if repo not in hub.repos:
                        return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    files = hub.repos[repo]["branches"].get(branch)
                    if files is None:
                        return self._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
                    return self._send(200, {"id": repo, "sha": hub.head(repo, branch), "private": hub.repos[repo]["private"],
                                            "siblings": [{"rfilename": f} for f in files]})
                if "resolve" in parts:  # /{repo}/resolve/{revision}/{file}
                    i = parts.index("resolve")
                    repo, branch, filename = "/".join(parts[:i]), parts[i + 1], "/".join(parts[i + 2:])
                    if repo not in hub.repos:
                        return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    files = hub.repos[repo]["branches"].get(branch)
                    if files is None:
                        return self._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
                    if filename not in files:
                        return self._send(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
                    data = files[filename]
                    return self._send(200, data, {"ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                                  "X-Repo-Commit": hub.head(repo, branch)})
                return self._send(404, {"error": f"unknown route {path}"})

            def do_POST(self):
                hub.requests.append((self.command, self.path))
                if not self._authorized():
                    return self._send(401, {"error": "Invalid credentials"})
                path = unquote(urlparse(self.path).path)
                parts = path.strip("/").split("/")
                body = self._body()
                if parts[:2] == ["api", "validate-yaml"]:
                    errors = hub.validate_card(json.loads(body)["content"])
                    return self._send(400 if errors else 200, {"errors": [{"message": e} for e in errors], "warnings": []})
                if parts[:3] == ["api", "repos", "create"]:
                    spec = json.loads(body)
                    repo = f"{spec['organization']}/{spec['name']}" if spec.get("organization") else spec["name"]
                    if repo in hub.repos:
                        return self._send(409, {"error": "You already created this model repo", "url": f"/{repo}"})
                    hub.repos[repo] = {"private": bool(spec.get("private")), "branches": {"main": {}}, "commits": []}
                    return self._send(200, {"url": f"{hub.url}/{repo}", "name": repo})
                if parts[:2] == ["api", "models"]:
                    for verb in ("preupload", "commit", "branch"):
                        if verb in parts:
                            i = parts.index(verb)
                            repo, branch = "/".join(parts[2:i]), "/".join(parts[i + 1:])
                            return getattr(self, f"_{verb}")(repo, branch, body)
                return self._send(404, {"error": f"unknown route {path}"})

            def _preupload(self, repo: str, branch: str, body: bytes):
                files = json.loads(body)["files"]
                return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                  for f in files], "commitOid": hub.head(repo, branch)})

            def _branch(self, repo: str, branch: str, body: bytes):
                branches = hub.repos[repo]["branches"]
                if branch not in branches:
                    branches[branch] = dict(branches["main"])
                return self._send(200, {})

            def _commit(self, repo: str, branch: str, body: bytes):
                lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                files = hub.repos[repo]["branches"].setdefault(branch, {})
                message = ""
                for line in lines:
                    if line["key"] == "header":
                        message = line["value"].get("summary", "")
                    elif line["key"] == "file":
                        value = line["value"]
                        files[value["path"]] = base64.b64decode(value["content"])
                    elif line["key"] == "deletedFile":
                        files.pop(line["value"]["path"], None)
                    else:
                        return self._send(400, {"error": f"unsupported commit operation {line['key']}"})
                oid = hashlib.sha1(json.dumps(sorted(files)).encode() + str(len(hub.repos[repo]["commits"])).encode()).hexdigest()
                hub.repos[repo]["commits"].append({"branch": branch, "oid": oid, "message": message})
                return self._send(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid,
                                        "commitMessage": message, "success": True})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def validate_card(self, content: str) -> list[str]:
        """What the Hub checks in README metadata that matters here: YAML front matter that parses to a
        mapping, string fields where strings are expected, and a model-index that converts to results."""
        import yaml
        from huggingface_hub.repocard_data import model_index_to_eval_results

        if not content.startswith("---\n"):
            return ["no YAML metadata block"]
        try:
            metadata = yaml.safe_load(content.split("---\n")[1])
        except yaml.YAMLError as error:
            return [f"YAML does not parse: {error}"]
        if not isinstance(metadata, dict):
            return ["metadata is not a mapping"]
        errors = [f"{key} must be a string" for key in ("license", "library_name", "pipeline_tag", "base_model")
                  if key in metadata and not isinstance(metadata[key], str)]
        if "tags" in metadata and not all(isinstance(t, str) for t in metadata["tags"]):
            errors.append("tags must be strings")
        if "model-index" in metadata:
            try:
                model_index_to_eval_results(metadata["model-index"])
            except Exception as error:  # malformed model-index
                errors.append(f"model-index is invalid: {error}")
        self.validated.append(metadata)
        return errors

    def head(self, repo: str, branch: str) -> str:
        commits = [c for c in self.repos[repo]["commits"] if c["branch"] == branch]
        return commits[-1]["oid"] if commits else "0" * 40

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def build_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str = "0123456789abcdef0123456789abcdef01234567") -> None:
    """Lay out `folder` as the Hugging Face cache does for a downloaded `repo_id` at `main`."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def cache_hub_dataset(cache: Path, repo_id: str, rows: list[dict]) -> None:
    """What `datasets` leaves in HF_DATASETS_CACHE after downloading the Hub dataset `repo_id` (one "train" split
    of `rows`): with HF_HUB_OFFLINE=1, `load_dataset(repo_id)` (streamed or not) reads it from there."""
    import datasets

    cache.mkdir(parents=True, exist_ok=True)
    source = cache / "source.jsonl"
    source.write_text("\n".join(json.dumps(row) for row in rows))
    builder = datasets.load_dataset_builder("json", data_files={"train": str(source)}, cache_dir=str(cache / "build"))
    builder.download_and_prepare()
    namespace, name = repo_id.split("/")
    prepared = next((cache / "build" / "json").glob("*/*/*"))  # config/version/hash
    target = cache / f"{namespace}___{name}" / "default" / prepared.parent.name / prepared.name
    shutil.copytree(prepared, target)
    for arrow in target.glob("json-*.arrow"):
        arrow.rename(target / arrow.name.replace("json-", f"{name}-", 1))
    shutil.rmtree(cache / "build")
    source.unlink()
