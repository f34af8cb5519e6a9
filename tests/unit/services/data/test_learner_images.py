"""The learner job's image bookkeeping (services.data.learner_images): no-ops for text data; for images, the
learner's inputs made from the pixels each prompt carried, a group whose image names are not its prompt's refused,
and the parity probe's images taken from the first prompts in turn."""
from __future__ import annotations

import numpy as np
import pytest
from image_samples import RULES, encoded, noise

from protocol import PromptRequest, TrajectoryGroup
from services.data.image_prompts import ImagePrompts, image_inputs
from services.data.images import PreparedImage, prepare_image
from services.data.learner_images import LearnerImages
from services.recipe.data import DataConfig


def picture(seed: int, size: int = 56):
    prepared = prepare_image(encoded(noise(size, size, seed=seed)), RULES)
    assert isinstance(prepared, PreparedImage)
    return ImagePrompts.wire([prepared])[0]


def request(pid: str, images: list) -> PromptRequest:
    return PromptRequest(pid, np.array([1, 2, 3]), {}, images=images)


def group_of(req: PromptRequest, image_ids: tuple[str, ...] | None = None) -> TrajectoryGroup:
    ids = tuple(i.sha256 for i in req.images) if image_ids is None else image_ids
    return TrajectoryGroup(f"e0:{req.prompt_id}:1", req.prompt_id, req.prompt_ids, [], 0, 16, image_ids=ids)


def test_text_data_make_no_image_inputs():
    images = LearnerImages.of(DataConfig(), "/no/model")  # the model is not read for text data
    req = request("p0", [])
    assert not images.in_use and images.vision_tokens == frozenset()
    assert images.step_inputs([(group_of(req), req)]) is None
    assert images.probe_images([req], 3) == ([], [])


def test_a_steps_inputs_are_made_from_the_pixels_each_prompt_carried():
    images = LearnerImages(RULES, frozenset({7, 8}))
    with_one, without = request("p0", [picture(0)]), request("p1", [])
    got = images.step_inputs([(group_of(with_one), with_one), (group_of(without), without)])
    assert got is not None and set(got) == {"p0"}  # a prompt without images has no inputs
    want = image_inputs(with_one.images, RULES)
    assert np.array_equal(got["p0"].pixel_values, want.pixel_values)
    assert np.array_equal(got["p0"].image_grid_thw, want.image_grid_thw)


def test_a_group_whose_image_names_are_not_its_prompts_is_refused():
    images = LearnerImages(RULES, frozenset())
    req = request("p0", [picture(0)])
    with pytest.raises(ValueError, match=r"group e0:p0:1: image_ids \['other'\] are not its prompt's images"):
        images.step_inputs([(group_of(req, ("other",)), req)])


def test_the_probes_sequences_take_the_first_prompts_images_in_turn():
    images = LearnerImages(RULES, frozenset())
    first = [request("p0", [picture(0)]), request("p1", [])]
    pictures, inputs = images.probe_images(first, 3)
    assert pictures == [first[0].images, [], first[0].images]
    assert inputs[1] is None and inputs[0] is not None and inputs[2] is not None
    assert np.array_equal(inputs[0].pixel_values, image_inputs(first[0].images, RULES).pixel_values)
    assert images.probe_images([], 3) == ([], [])
