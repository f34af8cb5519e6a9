"""A tiny model cached by an older version gets today's chat template (tools), and nothing else changes."""
from __future__ import annotations

from services.models.source import refresh_chat_template
from services.models.tiny_model import CHAT_TEMPLATE, build_tokenizer


def test_an_old_cached_chat_template_is_replaced_and_a_current_one_left_alone(tmp_path):
    build_tokenizer(tmp_path)
    path = tmp_path / "chat_template.jinja"
    assert path.read_text() == CHAT_TEMPLATE
    vocab = (tmp_path / "tokenizer.json").read_bytes()
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")  # what an older version wrote
    refresh_chat_template(tmp_path)
    assert path.read_text() == CHAT_TEMPLATE
    assert (tmp_path / "tokenizer.json").read_bytes() == vocab
    before = path.stat().st_mtime_ns
    refresh_chat_template(tmp_path)
    assert path.stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
