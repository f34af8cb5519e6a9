"""NeMo-RL GRPO recipes, read as they are: the rules that map each of their keys to Inflight's, or say why a key
is ignored here."""
