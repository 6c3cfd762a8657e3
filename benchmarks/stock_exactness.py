"""Per family of the architecture registry: how exactly a stock export reproduces the ghosted model it folds (max
logit difference, tiny random models with non-trivial norm gains and biases), or the one line that refuses it.

    python benchmarks/stock_exactness.py    # writes benchmarks/results/stock_exactness.md (about 20 s here)

The same construction as tests/test_architectures.py (which asserts 1e-4 of the logits' scale): a scaled rotation
1.3 Q at every boundary of removals [1, 2, 5] of 6 layers, norm eps 1e-12 (the fold is exact but for the eps)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from tiny import batch, tiny_family  # noqa: E402

from ghosted_hf import GhostedError, prune_layers, to_stock_model  # noqa: E402
from ghosted_hf.architectures import ARCHITECTURES  # noqa: E402
from ghosted_hf.remote.configuration_ghosted import expected_boundaries  # noqa: E402


def exactness(model_type: str) -> str:
    removed = [1, 2, 5]
    q, _ = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(3)))
    operators = {b["removed"][0]: 1.3 * q for b in expected_boundaries(6, removed)}
    ghosted = prune_layers(tiny_family(model_type, rms_norm_eps=1e-12), removed, operators, operator_kind="folded")
    with torch.no_grad():
        expected = ghosted(**batch()).logits
        try:
            got = to_stock_model(ghosted)(**batch()).logits
        except GhostedError as error:
            return f"refused: {str(error).split('(', 1)[1].split(')')[0]}"
    scale = float(expected.abs().max())
    return f"{float((got - expected).abs().max()):.1e} (logits up to {scale:.1f})"


def main() -> None:
    rows = [f"| `{t}` | {exactness(t)} |" for t in sorted(ARCHITECTURES)]
    text = "\n".join([__doc__.split("\n\n")[0].replace("\n", " "), "", "`python benchmarks/stock_exactness.py`, "
                      f"torch {torch.__version__}, float32 on CPU.", "",
                      "| `model_type` | stock export: max logit difference, or why it is refused |", "|---|---|", *rows])
    out = ROOT / "benchmarks" / "results" / "stock_exactness.md"
    out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
