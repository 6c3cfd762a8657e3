"""Statistics to operators: the operator kinds fitted in closed form, the selection criteria, sub-block maps."""
