"""export/image_data.py: deterministic, disjoint calibration and evaluation photos."""

import base64

import numpy as np

from export import image_data


def test_sets_are_disjoint_deterministic_and_varied():
    cal, ev = image_data.calibration_set(), image_data.evaluation_set()
    assert len(cal) == image_data.CALIBRATION_SIZE == 64 and len(ev) == image_data.EVALUATION_SIZE == 192
    # the photos the served model is tested on by class are never calibration photos
    assert {"chelsea.png", "coffee.png"} <= set(image_data.EVALUATION_PHOTOS)
    sources = lambda samples: {s.photo for s in samples}  # noqa: E731
    assert sources(cal) == set(image_data.CALIBRATION_PHOTOS)
    assert sources(ev) == set(image_data.EVALUATION_PHOTOS)
    assert not sources(cal) & sources(ev)
    assert all(s.image.mode == "RGB" for s in cal + ev)
    assert len({s.image.size for s in ev}) > 120  # crops of many sizes
    # every evaluation image has its photo's true ImageNet class
    labels = image_data.labels(ev)
    assert labels is not None and len(labels) == len(ev) and labels.min() >= 0 and labels.max() < 1000
    assert image_data.labels(cal) is None
    assert any("flip" in s.name for s in ev)
    # rebuilt from scratch: the same images, pixel for pixel
    first = image_data.pixel_values(ev[:8])
    image_data.evaluation_set.cache_clear()
    again = image_data.evaluation_set()
    assert [s.name for s in again] == [s.name for s in ev]
    np.testing.assert_array_equal(image_data.pixel_values(again[:8]), first)


def test_photo_packages_are_found_without_being_imported():
    import sys

    assert image_data.data_dir().name == "data" and image_data.imagenet_dir().name == "data"
    assert "skimage" not in sys.modules and "foolbox" not in sys.modules


def test_imagenet_photos_are_labelled_from_their_file_names():
    assert len(image_data.IMAGENET_PHOTOS) == 20
    for name in image_data.IMAGENET_PHOTOS:
        assert image_data.photo_path(name).is_file()
        assert image_data.label(name) == int(name.removesuffix(".jpg").split("_")[-1])
    assert image_data.label("chelsea.png") == 281 and image_data.label("coffee.png") == 967
    assert image_data.label("astronaut.png") is None
    # the package's photos are the ones listed: none missed, none invented
    assert {p.name for p in image_data.imagenet_dir().glob("imagenet_*.jpg")} == set(image_data.IMAGENET_PHOTOS)


def test_perf_analyzer_input_is_the_serialized_bytes_tensor():
    from tritonclient.utils import serialize_byte_tensor

    blobs = [image_data.encode(image_data.evaluation_set()[0].image, "JPEG"), b"\x89PNG..."]
    doc = image_data.perf_analyzer_input(blobs)
    assert len(doc["data"]) == 2
    for step, blob in zip(doc["data"], blobs):
        assert step["IMAGE"]["shape"] == [1]
        expected = serialize_byte_tensor(np.array([blob], dtype=object)).item()
        assert base64.b64decode(step["IMAGE"]["b64"]) == expected
