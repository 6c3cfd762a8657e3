"""Shared test setup: helpers live in tiny.py (models, text), isolated.py (processes without ghosted_hf)
and fake_hub.py (a local Hub). Under CI (CI=true), which installs every optional wheel, a skipped test
fails the run: nothing that should run may silently not run."""

import os
import sys
from pathlib import Path

import pytest

_skipped: list[str] = []

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # The pytest-xdist workers (pyproject's addopts start one per core) and the processes they start share the
    # cores: more threads than cores make torch's OpenMP threads wait on each other.
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    import torch

    torch.set_num_threads(_threads)


@pytest.fixture
def dense_folder(tmp_path: Path) -> Path:
    """A saved tiny dense Llama with its tokenizer, and calibration text in tmp_path / "cal.txt"."""
    from tiny import build, char_tokenizer, texts

    build("llama").save_pretrained(tmp_path / "dense")
    char_tokenizer().save_pretrained(tmp_path / "dense")
    (tmp_path / "cal.txt").write_text("\n\n".join(texts()))
    return tmp_path / "dense"


@pytest.fixture
def fake_demo(monkeypatch, tmp_path: Path) -> list[tuple]:
    """`ghosted demo` with its pass replaced (the real-model tests run it): each run records (model, the options'
    num_layers) and saves a config.json only; run in tmp_path."""
    import json

    import ghosted_hf.pipelines.demo

    runs: list[tuple] = []

    def fake_run(output, options, model=None, eval_windows=16):
        runs.append((model, options.num_layers))
        Path(output).mkdir(parents=True, exist_ok=True)
        (Path(output) / "config.json").write_text(json.dumps({"removed_layers": [1]}))
        return []

    monkeypatch.setattr(ghosted_hf.pipelines.demo, "run_demo", fake_run)
    monkeypatch.setattr(ghosted_hf.pipelines.demo, "format_rows", lambda rows, removed, tokens: "table")
    monkeypatch.chdir(tmp_path)
    return runs


def _gpu_tests_run() -> bool:
    import torch

    return torch.cuda.is_available() or bool(os.environ.get("GHOSTED_GPU_TESTS_DEVICE"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every compat, distributed or real-model test is slow too: `pytest -m "not slow"` leaves them all out, and
    the slow ones run first.
    The gpu tests (tests/test_gpu.py) are deselected where no CUDA device can run them, the torchvision and
    llama_cpp_build ones where torchvision or llama-cpp-python does not import, and the header says so."""
    for item in items:
        if any(item.get_closest_marker(name) for name in ("compat", "distributed", "real_model")):
            item.add_marker(pytest.mark.slow)
    # The slow tests first (in their order), so that no long test starts last while the other worker has nothing left.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    for marker, runs in (("gpu", _gpu_tests_run()), ("torchvision", _imports("torchvision")),
                         ("llama_cpp_build", _imports("llama_cpp"))):
        out = [item for item in items if item.get_closest_marker(marker)] if not runs else []
        if out:
            config.hook.pytest_deselected(items=out)
            items[:] = [item for item in items if not item.get_closest_marker(marker)]


def _imports(module: str) -> bool:
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # absent, a torchvision built for another torch ("operator torchvision::nms does not exist"),
        return False   # llama-cpp-python without a llama.cpp library (LLAMA_CPP_LIB_PATH)
    return True


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [("gpu tests: collected (CUDA available)" if _gpu_tests_run() else
             "gpu tests: deselected (no CUDA device; `pytest -m gpu` on a GPU machine runs them)"),
            ("torchvision tests: collected" if _imports("torchvision") else
             "torchvision tests: deselected (torchvision does not import; `pip install torch==2.14.1 "
             "torchvision==0.29.1` and `pytest -m torchvision` run them)"),
            ("llama_cpp_build tests: collected" if _imports("llama_cpp") else
             "llama_cpp_build tests: deselected (llama-cpp-python does not import; benchmarks/serving.py says how to "
             "build llama.cpp and install it on that build)")]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI") == "true" and _skipped and exitstatus == 0:
        print(f"\nCI: {len(_skipped)} test(s) were skipped, but CI installs everything they need: {_skipped}",
              file=sys.stderr)
        session.exitstatus = 1
