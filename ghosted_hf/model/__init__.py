"""Operators into a model: layer surgery, the provenance record, what a checkpoint is, loading for calibration."""
