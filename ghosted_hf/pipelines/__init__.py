"""The recipes that run the flow end to end: prune, export a stock checkpoint or a GGUF, heal, the demo."""
