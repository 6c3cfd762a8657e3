"""Calibration statistics: declarations -> plans -> passes over a model -> a store with its file format.

`declarations` names every statistic once; `plan` combines them; `capture` and `accumulate` turn one
forward pass into float64 sums; `passes` runs the full model (and `layerwise` one decoder layer at a time)
behind one interface; `store` holds the sums, writes and merges files; `origin` fingerprints the model.
"""

from .patch import Patch
from .declarations import (ABS, ANGULAR, COSINE, CROSS, ENERGY, GRAM, LABELS, LOSS, MLP_GRAM, MLP_SOURCE, MLP_TARGET,
                           NORMED_CROSS, NORMED_GRAM, NORMED_SOURCE, ROTATED_ABS, SUBBLOCK_SUMS, Entry, Statistic)
from .layerwise import LayerwisePass
from .origin import check_same_model, model_fingerprint
from .passes import CalibrationPass, Calibrator, FullModelPass, as_calibration_pass, collect_statistics
from .plan import StatisticsPlan, least_squares, mlp_terms, next_token_loss, normed_terms, similarity, subblock_terms
from .store import CalibrationStatistics, ShardSpec

__all__ = ["ABS", "ANGULAR", "COSINE", "CROSS", "ENERGY", "GRAM", "LABELS", "LOSS", "MLP_GRAM", "MLP_SOURCE",
           "MLP_TARGET", "NORMED_CROSS", "NORMED_GRAM", "NORMED_SOURCE", "ROTATED_ABS", "SUBBLOCK_SUMS",
           "CalibrationPass", "CalibrationStatistics", "Calibrator", "Entry", "FullModelPass", "LayerwisePass", "Patch",
           "ShardSpec", "Statistic", "StatisticsPlan", "as_calibration_pass", "check_same_model", "collect_statistics",
           "least_squares", "mlp_terms", "model_fingerprint", "next_token_loss", "normed_terms", "similarity",
           "subblock_terms"]
