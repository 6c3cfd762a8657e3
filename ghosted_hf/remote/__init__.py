"""The only files copied next to a saved model's weights (loaded with ``trust_remote_code=True``)."""
