"""Images end to end through the real parts: a tiny random Qwen2.5-VL in vLLM (CPU) samples groups on image
prompts built by the job's image path; the Megatron-Core learner trains a step on them with the vision tower
unfrozen, exports its weights, the engine installs them in flight; afterwards the engine's log-probs on the image
prompts changed and equal the learner's (so no vLLM cache served features of the old tower), and the learner's
pixel values are made from the same pixels the engine was given."""
from __future__ import annotations

import asyncio
import io
import threading

import numpy as np
import pytest

from protocol import PromptRequest, TrajectoryGroup, decode, encode

PARITY_ATOL = 2e-3
"""Engine (vLLM CPU, fp32) vs learner (Megatron-Core, fp32) response log-probs, max abs difference."""
SIZES = [(96, 72), (140, 56), (64, 64)]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from services.models.tiny_vlm import make_tiny_vlm
    return str(make_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm-refit"), seed=0))


@pytest.fixture(scope="module")
def engine(vlm_dir):
    from rollout.config import GenerationConfig, VllmConfig
    from rollout.engine import RolloutEngine
    from rollout.rewards.registry import get_reward_fn

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    gen = GenerationConfig(max_new_tokens=8, request_timeout_s=120.0, max_retries=0,
                           vllm_cfg=VllmConfig(enforce_eager=True, precision="float32", seed=0))
    eng = RolloutEngine(vlm_dir, gen, 512, get_reward_fn("repeat_letter"), engine_id="vlm", initial_version=0)
    run = lambda coro, t=300: asyncio.run_coroutine_threadsafe(coro, loop).result(t)  # noqa: E731
    run(eng.start())
    yield eng, run
    run(eng.shutdown(), 120)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def prompts(vlm_dir):
    """Image prompts made the way the job makes them: the image pool, image parts in the chat turn, the
    placeholders expanded."""
    from PIL import Image
    from transformers import AutoTokenizer

    from services.data.image_pool import ImagePool
    from services.data.image_prompts import ImagePrompts, image_token_id
    from services.data.prompt_template import PromptTemplate
    from services.recipe.data import DataConfig

    rng = np.random.default_rng(0)
    rows = []
    for w, h in SIZES:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
        rows.append({"image": buf.getvalue()})
    d = DataConfig(image_key="image", image_workers=2)
    images = ImagePrompts(ImagePool.for_data(d, vlm_dir), d.row_images, image_token_id(vlm_dir))
    template = PromptTemplate(AutoTokenizer.from_pretrained(vlm_dir))
    out = []
    try:
        for k, row in enumerate(rows):
            prepared = images.prepare(row, None)
            turns = ImagePrompts.with_image_parts(template.messages("How many objects?"), len(prepared))
            ids = images.expand(template.ids(turns=turns), prepared)
            out.append(PromptRequest(f"img-{k}", np.asarray(ids), {"target_token_ids": "5,6"},
                                     images=ImagePrompts.wire(prepared)))
    finally:
        images.close()
    return out


def image_inputs_of(requests, vlm_dir):
    from services.data.image_prompts import image_inputs
    from services.data.images import ImageRules

    rules = ImageRules.from_pretrained(vlm_dir)
    return [image_inputs(r.images, rules) for r in requests]


def test_groups_on_image_prompts_carry_image_names_and_depend_on_the_pixels(engine, prompts):
    eng, run = engine

    async def groups():
        return [g async for g in eng.generate(prompts, 4)]
    got = {g.prompt_id: g for g in run(groups())}
    for p in prompts:
        g = decode(encode(got[p.prompt_id]), expect=TrajectoryGroup)
        assert g.image_ids == (p.images[0].sha256,)
        assert len(g.valid) == 4, [t.error for t in g.trajectories]
        assert np.array_equal(g.prompt_ids, p.prompt_ids)  # expanded placeholders, as the learner sees them
    # the same tokens with other pixels (the image flipped) score differently: the engine reads the pixels
    image = prompts[0].images[0]
    flipped = type(image)("f" * 64, image.pixels[::-1].copy())
    resp = [[10, 11, 12, 13]] * 2
    a, b = run(eng.logprobs_of([prompts[0].prompt_ids.tolist()] * 2, resp, [[image], [flipped]]))
    assert np.abs(a - b).max() > 1e-3


def test_the_tower_alone_changing_is_seen_by_the_engine(engine, prompts, vlm_dir, tmp_path):
    """A push that changes only ``visual.*`` changes image-prompt log-probs: the encoder's cached outputs (named
    by image and version, rollout/vllm_images.py) are not reused across the install."""
    from model_weights import model_tensors

    from protocol import pack_buckets
    from services.models.tiny_vlm import make_tiny_vlm

    eng, run = engine
    other = make_tiny_vlm(tmp_path / "seed1", seed=1)
    current = {n: (dt, sh, b) for n, dt, sh, b in model_tensors(vlm_dir)}
    towers = {n: (dt, sh, b) for n, dt, sh, b in model_tensors(str(other)) if n.startswith("visual.")}
    ids, resp = [p.prompt_ids.tolist() for p in prompts], [[10, 11, 12]] * len(prompts)
    before = run(eng.logprobs_of(ids, resp, [p.images for p in prompts]))
    text = run(eng.logprobs_of([[5, 6, 7, 8]], [[10, 11, 12]]))
    manifest, buckets = pack_buckets([(n, *(towers.get(n) or current[n])) for n in current], eng.version + 1, 1 << 20)
    run(eng.install(manifest, buckets))
    after = run(eng.logprobs_of(ids, resp, [p.images for p in prompts]))
    assert all(np.abs(a - b).max() > 1e-3 for a, b in zip(before, after, strict=True))
    assert np.allclose(run(eng.logprobs_of([[5, 6, 7, 8]], [[10, 11, 12]]))[0], text[0], atol=1e-5)  # LM unchanged


def test_a_push_that_trains_the_tower_changes_image_prompts_and_engine_equals_learner(engine, prompts, vlm_dir):
    from learner.config import LossConfig, MegatronConfig, OptimizerConfig, SequencePackingConfig
    from learner.trainer import Learner

    eng, run = engine

    async def groups():
        return [g async for g in eng.generate(prompts, 4)]
    batch = [decode(encode(g), expect=TrajectoryGroup) for g in run(groups())]
    for g in batch:  # rewards with a spread, so the step moves the weights
        for i, t in enumerate(g.trajectories):
            t.reward = float(i)
    resp = [[10, 11, 12, 13, 14]] * len(prompts)
    ids = [p.prompt_ids.tolist() for p in prompts]
    before = run(eng.logprobs_of(ids, resp, [p.images for p in prompts]))

    megatron = MegatronConfig(precision="float32", optimizer=OptimizerConfig(lr=3e-2, weight_decay=0.0))
    learner = Learner(vlm_dir, megatron, LossConfig(), SequencePackingConfig(train_mb_tokens=256),
                      max_total_sequence_length=256, freeze_vision_tower=False)
    try:
        images = dict(zip([p.prompt_id for p in prompts], image_inputs_of(prompts, vlm_dir), strict=True))
        learner.policy_version = eng.version  # the engine's count went on without this learner (earlier test)
        learner.train_step(batch, images)
        exported = learner.export_weights(1 << 20)
        assert exported is not None
        manifest, buckets = exported
        tower = {t.name for t in manifest.tensors if t.name.startswith("visual.")}
        assert tower, "the export carries the vision tower"
        assert run(eng.install(manifest, buckets)) == manifest.version
        after = run(eng.logprobs_of(ids, resp, [p.images for p in prompts]))
        mine = learner.logprobs([np.asarray(i) for i in ids], [np.asarray(r) for r in resp],
                                image_inputs_of(prompts, vlm_dir))
    finally:
        learner.shutdown()
    assert max(np.abs(a - b).max() for a, b in zip(before, after, strict=True)) > 1e-2
    diff = max(np.abs(a - m).max() for a, m in zip(after, mine, strict=True))
    assert diff <= PARITY_ATOL, f"engine vs learner after the push: max |diff| {diff:.2e}"
