"""Model card templates, installed as `ghosted_hf.model_cards`."""
