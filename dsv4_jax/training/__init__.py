"""Training DeepSeek-V4 with optax: the corpus and tokenizer (data.py), the losses
(objective.py), the run and its directory (trainer.py)."""
