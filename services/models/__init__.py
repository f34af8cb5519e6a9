"""Models: where a recipe's model comes from, its variants (tokenizer, config overrides), its files shared
with other nodes, and the tiny local models tests and defaults build."""
