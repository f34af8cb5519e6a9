"""The recipe: the typed Recipe model and its sections, loading and rules, the files it names, the docs of
its keys, the checks before anything starts and the NeMo-RL tables."""
