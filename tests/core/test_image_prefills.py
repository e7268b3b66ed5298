"""How the engine advances a prompt with images (image_prefills.py), step by step, against a vision
path that records each window: the step budget, keep points, and one image encode per step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from services.core.image_prefills import ImagePrefill, ImagePrefills
from services.core.vision.kept_by_image import KeptByImage
from services.core.vision.prefill import VisionPrefill
from services.core.vision.prompt_images import PromptImage, PromptImages

IMAGE = 9


class RecordingVision:
    """Stands in for VisionPrefill: records each window and encodes (keeps) the images in it."""

    def __init__(self, both_ways: bool = False):
        self.features = KeptByImage(1 << 20)
        self.windows: list[tuple[int, int]] = []
        self.both_ways = both_ways

    window_stop = VisionPrefill.window_stop

    def prefill(self, cache, prompt, images, positions, start, stop):
        self.windows.append((start, stop))
        first = 0
        for position, token in enumerate(prompt[:stop]):
            if token == IMAGE and (position == 0 or prompt[position - 1] != IMAGE):
                image = images.images[first]
                first += 1
                if position + image.tokens > start:
                    self.features.put(image.hash, (None, None), 1)
        return stop


def prefill_of(prompt: list[int], hashes: list[str], tokens: int, done: int = 0) -> ImagePrefill:
    images = PromptImages(
        tuple(PromptImage(h, np.zeros(1), (1, 2, 2), tokens, (IMAGE,) * tokens) for h in hashes), IMAGE
    )
    request = SimpleNamespace(prompt=prompt, images=images, request_id="r")
    return ImagePrefill(SimpleNamespace(request=request), [], done, done, None)


def run_to_end(prefills: ImagePrefills, budget: int) -> None:
    while prefills.pending:
        prefills.task(budget)()
        prefills.ready()


def test_two_new_images_are_encoded_in_two_steps_within_the_budget():
    vision, kept = RecordingVision(), []
    prefills = ImagePrefills(lambda: vision, lambda sequence, cache, done: kept.append(done))
    prompt = [1, 2, *[IMAGE] * 4, 3, *[IMAGE] * 4, 4, 5, 6]  # images at 2..5 and 7..10; 14 positions
    prefills.add(prefill_of(prompt, ["a" * 64, "b" * 64], 4))
    run_to_end(prefills, budget=100)
    # the first step stops before the second image; the next stops just past it (a keep point)
    assert vision.windows == [(0, 7), (7, 11), (11, 13)]
    assert kept == [11, 13]  # past the last image, and every prompt position but the last


def test_an_encoded_image_does_not_split_the_window():
    vision = RecordingVision()
    vision.features.put("a" * 64, (None, None), 1)
    prefills = ImagePrefills(lambda: vision, lambda *args: None)
    prompt = [1, 2, *[IMAGE] * 4, 3, *[IMAGE] * 4, 4, 5, 6]
    prefills.add(prefill_of(prompt, ["a" * 64, "b" * 64], 4))
    run_to_end(prefills, budget=100)
    assert vision.windows == [(0, 11), (11, 13)]


def test_the_step_budget_cuts_windows_and_a_cached_prefix_starts_later():
    vision, kept = RecordingVision(), []
    prefills = ImagePrefills(lambda: vision, lambda sequence, cache, done: kept.append(done))
    prompt = [1, *[IMAGE] * 4, *range(20, 30)]  # the image at 1..4; 15 positions
    prefills.add(prefill_of(prompt, ["c" * 64], 4, done=3))  # the prefix cache held 3 positions
    run_to_end(prefills, budget=4)
    assert vision.windows == [(3, 5), (5, 9), (9, 13), (13, 14)]
    assert kept == [5, 14]


def test_where_images_attend_both_ways_a_window_holds_each_image_whole():
    """A budget of 3 would cut both images; each window grows to the end of the image it reaches,
    so every image position is computed beside the whole image."""
    vision = RecordingVision(both_ways=True)
    prefills = ImagePrefills(lambda: vision, lambda *args: None)
    prompt = [1, 2, *[IMAGE] * 4, 3, *[IMAGE] * 4, 4, 5, 6]  # images at 2..5 and 7..10
    prefills.add(prefill_of(prompt, ["d" * 64, "e" * 64], 4))
    run_to_end(prefills, budget=3)
    assert vision.windows == [(0, 6), (6, 11), (11, 13)]
