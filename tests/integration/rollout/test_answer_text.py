"""The engine's event loop stays light while it samples: vLLM does not detokenize each token and log-prob (the
answer is decoded once, ``rollout.engine.answer_text``) and the heap vLLM left at start is frozen out of the
garbage collector's full passes (``rollout.gc_heap``). The text decoded once equals vLLM's own, token-by-token
text, for answers of the tiny model's random bytes (many end inside a character) and in both version-labelling
modes."""
from __future__ import annotations

import gc

import pytest

from rollout import gc_heap
from rollout.engine import answer_text
from services.data.tasks import make_prompts

from rollout_engine_helpers import GROUP_SIZE


@pytest.mark.parametrize("streamed", [False, True])
def test_the_answer_decoded_once_is_the_text_vllm_detokenizes(harness, streamed):
    engine, seen = harness.engine, []
    sampler = engine.sampler
    text_of, labels_streamed = sampler.text_of, engine.labels.streamed
    assert text_of is not None                        # set at start: vLLM samples without detokenizing
    sampler.text_of, engine.labels.streamed = None, streamed   # this once, vLLM detokenizes as before
    sampler._text = lambda params, ids, text: seen.append((list(ids), text)) or text
    try:
        for request in make_prompts("repeat_letter", engine.tokenizer, 4, seed=31):
            harness.run(engine.generate_group(request, GROUP_SIZE))
    finally:
        del sampler._text
        sampler.text_of, engine.labels.streamed = text_of, labels_streamed
    assert len(seen) == 4 * GROUP_SIZE
    assert [text for _, text in seen] == [answer_text(engine.tokenizer, ids) for ids, _ in seen]
    assert any(answer_text(engine.tokenizer, ids) != engine.tokenizer.decode(ids, skip_special_tokens=True)
               for ids, _ in seen)               # some end inside a character: the case one plain decode gets wrong


def test_the_running_engine_froze_the_heap(harness):
    assert gc_heap.running() >= 1 and gc.get_freeze_count() > 100_000
