"""A model to files and back: staged and verified folders, the model card, the summary, the Hub."""
