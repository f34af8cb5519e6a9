"""The offline verbs on a run directory or an exported model: export to Hugging Face, eval and generate
through a local engine."""
