"""Model card and Hub push/pull, against a local server that the real huggingface_hub client talks to."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub, build_hub_cache
from huggingface_hub import ModelCard
from isolated import assert_loads_with_same_logits
from safetensors.torch import load_file, save_file
from tiny import batch, build, char_tokenizer, texts

from ghosted_hf import ghost_prune
from ghosted_hf.errors import GhostedError
from ghosted_hf.io.card import build_card, save_with_card
from ghosted_hf.io.hub import push_to_hub
from ghosted_hf.remote.format_ghosted import ghost_tensor_key

EVALUATION = [{"task_type": "text-generation", "dataset_type": "wikipedia", "dataset_name": "Wikipedia (held-out articles)",
               "metric_type": "perplexity", "metric_value": 12.5}]


@pytest.fixture(scope="module")
def ghosted():
    model = ghost_prune(build("qwen3"), char_tokenizer(), texts(), num_layers=2, seq_len=48, num_sequences=24)
    model.config.ghost_provenance["evaluation"] = EVALUATION
    return model


def test_card_parses_back_with_the_config_numbers(ghosted, tmp_path: Path) -> None:
    save_with_card(ghosted, tmp_path, char_tokenizer(), repo_id="tester/tiny-ghost", license="apache-2.0")
    card = ModelCard.load(tmp_path / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"ghosted-layers", "layer-pruning", "custom_code"} <= set(data["tags"]) and data["license"] == "apache-2.0"
    result = card.data.eval_results[0]
    assert (result.metric_type, result.metric_value) == ("perplexity", 12.5)
    config = ghosted.config
    prov = config.ghost_provenance
    body = card.text
    assert f"removed {config.removed_layers}" in body
    assert prov["calibration"]["sha256"] in body and f"{prov['calibration']['tokens_used']} tokens" in body
    fit = config.ghost_boundaries[0]["fit"]
    assert f"relative_residual={fit['relative_residual']:.4g}" in body
    assert f"{prov['parameters']['dense']:,} -> {prov['parameters']['pruned']:,}" in body
    assert 'trust_remote_code=True' in body and "2605.15491" in body and prov["versions"]["transformers"] in body
    for name, score in prov["selection"]["scores"].items():
        assert f"| {name}" in body and f"{score:.6g}" in body


def test_card_includes_the_selection_plot(ghosted, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    save_with_card(ghosted, tmp_path, char_tokenizer())
    assert (tmp_path / "selection_scores.png").read_bytes().startswith(b"\x89PNG")
    assert "![selection scores](selection_scores.png)" in (tmp_path / "README.md").read_text()


def test_the_plot_draws_scores_that_span_decades_on_a_log_axis(ghosted, tmp_path: Path, monkeypatch) -> None:
    """The removed candidate's fit residual is often far below the rest: a linear axis draws its bar as nothing."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from ghosted_hf.io.card import score_axis_scale, write_score_plot

    assert score_axis_scale([0.01, 0.5, 2.0]) == "log" and score_axis_scale([0.5, 1.0, 2.0]) == "linear"
    assert score_axis_scale([0.0, 0.5, 20.0]) == "linear" and score_axis_scale([-1.0, 30.0]) == "linear"
    scales = []
    monkeypatch.setattr(Axes, "set_yscale", lambda self, value, **kw: scales.append(value))
    config = copy.deepcopy(ghosted.config)
    names = list(config.ghost_provenance["selection"]["scores"])
    config.ghost_provenance["selection"]["scores"] = {n: 10.0 ** -i for i, n in enumerate(names)}
    write_score_plot(config, tmp_path)
    assert scales == ["log"]


@pytest.mark.slow
def test_cli_push(ghosted, tmp_path: Path) -> None:
    save_with_card(ghosted, tmp_path / "model", char_tokenizer())
    with FakeHub() as hub:
        done = subprocess.run([sys.executable, "-m", "ghosted_hf.cli", "push", str(tmp_path / "model"), "tester/cli-ghost",
                               "--revision", "v2"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": hub.token})
    assert done.returncode == 0, done.stderr
    commit = hub.repos["tester/cli-ghost"]["commits"][0]["oid"]
    assert f"in commit {commit}" in done.stdout and f'revision="{commit}"' in done.stdout
    assert "model.safetensors" in hub.repos["tester/cli-ghost"]["branches"]["v2"]


def test_push_refuses_a_truncated_or_altered_folder(ghosted, tmp_path: Path) -> None:
    folder = save_with_card(ghosted, tmp_path / "model", char_tokenizer())
    weights = folder / "model.safetensors"
    intact = weights.read_bytes()
    with FakeHub() as hub:
        weights.write_bytes(intact[: len(intact) // 2])  # a save killed while writing the weights
        with pytest.raises(GhostedError, match=r"model.safetensors is damaged or truncated") as raised:
            push_to_hub(folder, "tester/broken", token=hub.token, endpoint=hub.url)
        assert str(folder / "model.safetensors") in str(raised.value)  # the user's folder, not the staging copy
        config = json.loads((folder / "config.json").read_text())
        key = ghost_tensor_key(config["ghost_boundaries"][0])
        weights.write_bytes(intact)
        tensors = load_file(weights)
        tensors[key][0, 0] += 1.0  # finite, well-formed, but not what was saved
        save_file(tensors, weights, metadata={"format": "pt"})
        with pytest.raises(GhostedError, match=rf"Operator tensor {key} does not match the sha256 in config.json"):
            push_to_hub(folder, "tester/broken", token=hub.token, endpoint=hub.url)
    assert "tester/broken" not in hub.repos  # nothing was uploaded, not even an empty repo


def test_push_while_offline_is_one_clear_error(ghosted, tmp_path: Path) -> None:
    folder = save_with_card(ghosted, tmp_path / "model", char_tokenizer())
    with pytest.raises(GhostedError, match=r"Cannot reach the Hub at http://127.0.0.1:9 to push tester/x"):
        push_to_hub(folder, "tester/x", token="t", endpoint="http://127.0.0.1:9")


def test_card_base_model_and_license_come_from_a_converted_base(ghosted, tmp_path: Path) -> None:
    (tmp_path / "SOURCE.json").write_text(json.dumps({"hub_id": "org/base-model", "license": "mit"}))
    config = copy.deepcopy(ghosted.config)  # the module-scoped model stays as built
    config.ghost_provenance = {**config.ghost_provenance, "base_model": str(tmp_path), "base_model_license": None}
    data = build_card(config).data.to_dict()
    assert data["base_model"] == "org/base-model" and data["license"] == "mit"


@pytest.mark.slow
def test_push_then_load_by_repo_id_in_a_fresh_process(ghosted, tmp_path: Path, monkeypatch) -> None:
    with FakeHub() as hub:
        pushed = push_to_hub(ghosted, "tester/tiny-ghost", tokenizer=char_tokenizer(), token=hub.token,
                             revision="v1", endpoint=hub.url)
    commits = hub.repos["tester/tiny-ghost"]["commits"]
    assert [c["oid"] for c in commits] == [pushed.commit, pushed.card_commit]  # files, then the pinned card
    assert pushed.commit_url == f"{hub.url}/tester/tiny-ghost/commit/{pushed.commit}"
    arrived = hub.repos["tester/tiny-ghost"]["branches"]["v1"]
    card = arrived["README.md"].decode()
    assert f'revision = "{pushed.commit}"' in card and 'AutoTokenizer.from_pretrained("tester/tiny-ghost", ' \
        "revision=revision, trust_remote_code=True)" in card
    assert {"config.json", "model.safetensors", "README.md", "configuration_ghosted.py", "modeling_ghosted.py",
            "tokenizer.json"} <= set(arrived)
    assert hub.validated and "ghosted-layers" in hub.validated[-1]["tags"]  # the Hub's metadata check passed
    assert json.loads(arrived["config.json"])["removed_layers"] == ghosted.config.removed_layers

    folder = tmp_path / "arrived"
    folder.mkdir()
    for name, data in arrived.items():
        (folder / name).write_bytes(data)
    build_hub_cache(tmp_path / "cache", "tester/tiny-ghost", folder)
    out = assert_loads_with_same_logits("tester/tiny-ghost", ghosted, batch(), tmp_path,
                                        env={"HF_HUB_CACHE": str(tmp_path / "cache")})
    assert "LOADED transformers_modules" in out


def test_push_errors(ghosted, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-login"))
    with pytest.raises(ValueError, match="No Hugging Face token"):
        push_to_hub(ghosted, "tester/x")
    build("llama").save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="holds a 'llama' model, not a ghosted one"):
        push_to_hub(tmp_path / "plain", "tester/x", token="t")
    ghosted.save_pretrained(tmp_path / "nocard")
    with pytest.raises(ValueError, match=r"lacks \['README.md'\]"):
        push_to_hub(tmp_path / "nocard", "tester/x", token="t")
    save_with_card(ghosted, tmp_path / "partial")
    (tmp_path / "partial" / "format_ghosted.py").unlink()  # modeling_ghosted.py and configuration_ghosted.py import it
    with pytest.raises(ValueError, match=r"lacks \['format_ghosted.py'\]"):
        push_to_hub(tmp_path / "partial", "tester/x", token="t")
    with FakeHub() as hub:
        hub.repos["tester/taken"] = {"private": False, "commits": [],
                                     "branches": {"main": {"config.json": json.dumps({"model_type": "bert"}).encode()}}}
        with pytest.raises(ValueError, match="already holds a 'bert' model"):
            push_to_hub(ghosted, "tester/taken", token=hub.token, endpoint=hub.url)


def test_push_to_an_endpoint_that_never_answers_ends_in_one_error(ghosted, tmp_path: Path) -> None:
    """A server that accepts connections and never answers: the push gives up after `timeout`, it does not hang."""
    import socket
    import time

    folder = save_with_card(ghosted, tmp_path / "model", char_tokenizer())
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # connections are accepted by the kernel and never read
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(GhostedError, match=rf"Cannot reach the Hub at {url} .* did not answer within 2 s"):
            push_to_hub(folder, "tester/x", token="t", endpoint=url, timeout=2)
    assert time.monotonic() - started < 60


def test_push_sends_the_bytes_it_verified(ghosted, tmp_path: Path, monkeypatch) -> None:
    """The folder changes after verification (weights truncated): what is uploaded is the verified copy."""
    from ghosted_hf.io import hub

    folder = save_with_card(ghosted, tmp_path / "model", char_tokenizer())
    original = (folder / "model.safetensors").read_bytes()
    verify = hub.check_ghosted_folder

    def verify_then_damage(staged: Path):
        config = verify(staged)
        (folder / "model.safetensors").write_bytes(original[:100])  # the user's folder, right after the check
        return config

    monkeypatch.setattr(hub, "check_ghosted_folder", verify_then_damage)
    with FakeHub() as fake:
        push_to_hub(folder, "tester/staged", token=fake.token, endpoint=fake.url)
    arrived = fake.repos["tester/staged"]["branches"]["main"]
    assert arrived["model.safetensors"] == original


def test_the_saved_tokenizer_class_loads_on_transformers_4_and_5(ghosted, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = save_with_card(ghosted, tmp_path / "model", char_tokenizer())
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert AutoTokenizer.from_pretrained(folder)("hello")["input_ids"] == char_tokenizer()("hello")["input_ids"]


def test_push_refuses_links_that_leave_the_folder_and_lists_extra_files(ghosted, tmp_path: Path, caplog) -> None:
    """A link to a file (or folder) outside the model folder would upload what it points to: refused, named;
    links inside the folder and ordinary extra files are uploaded, each listed before the upload."""
    secret = tmp_path / "token.txt"
    secret.write_text("hf_secret")
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "key").write_text("secret")
    with FakeHub() as hub:
        for name, target in (("notes.txt", secret), ("tokenizer.json", secret), ("keys", tmp_path / "private"),
                             ("nested/deep.txt", secret)):
            folder = save_with_card(ghosted, tmp_path / f"model-{name.replace('/', '-')}", char_tokenizer())
            link = folder / name
            link.parent.mkdir(exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to(target)
            with pytest.raises(GhostedError, match=rf"symbolic links to files outside it.*{name} -> {target}"):
                push_to_hub(folder, "tester/leak", token=hub.token, endpoint=hub.url)
        assert "tester/leak" not in hub.repos
        folder = save_with_card(ghosted, tmp_path / "model-ok", char_tokenizer())
        (folder / "notes.txt").write_text("how it was made")
        (folder / "sub").mkdir()
        (folder / "sub" / "data.txt").write_text("x")
        (folder / "alias.txt").symlink_to(folder / "notes.txt")  # stays inside the folder: its content is ours
        with caplog.at_level("WARNING", logger="ghosted_hf.io.hub"):
            push_to_hub(folder, "tester/ok", token=hub.token, endpoint=hub.url)
    assert "Uploading 3 file(s) besides the model's own: alias.txt, notes.txt, sub/data.txt" in caplog.text
    arrived = hub.repos["tester/ok"]["branches"]["main"]
    assert arrived["alias.txt"] == b"how it was made" and "sub/data.txt" in arrived


def test_a_saved_cards_snippet_loads_the_model_it_describes(ghosted, tmp_path: Path, monkeypatch) -> None:
    """The card of a folder saved locally loads that folder (its path, not its last name) in a fresh process, and
    renders no run of blank lines where the chart would go when there is none."""
    import ghosted_hf.io.card

    monkeypatch.setattr(ghosted_hf.io.card, "write_score_plot", lambda config, folder: None)  # as without matplotlib
    folder = save_with_card(ghosted, tmp_path / "models" / "mine", char_tokenizer())
    card = (folder / "README.md").read_text()
    assert "\n\n\n" not in card and "pypi.org" not in card
    snippet = card.split("```python\n")[1].split("```")[0]
    assert f'from_pretrained("{folder}"' in snippet
    script = snippet + "\nprint(type(model).__name__, model.config.removed_layers)\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    name, _, removed = done.stdout.strip().splitlines()[-1].partition(" ")
    assert name == "GhostedForCausalLM" and json.loads(removed) == ghosted.config.removed_layers, done.stdout
