"""Data for training the small embedded model pair: a chat corpus and its tokenizer."""
