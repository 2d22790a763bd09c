"""Decode and preprocess images for an ImageNet classifier: encoded bytes -> normalised NCHW float32.

Two recipes, chosen by the model's config (``resize_mode``), each what its weights were trained with:

* ``resize_then_crop``, torchvision's ImageNet evaluation transform (ResNet-50), step for step on
  PIL images: ``Resize(256)`` (shorter side to 256, the longer side truncated as torchvision
  computes it), ``CenterCrop(224)`` (offsets rounded with Python's ``round``), ``ToTensor`` (/255)
  and ``Normalize(mean, std)``, all in float32 and in the same order, so the served pixels equal
  a torchvision pipeline's on the same decoded image.
* ``crop_then_resize``, tensorflow/tpu's EfficientNet evaluation (``preprocessing.py``
  ``_decode_and_center_crop``): a centred square of ``crop / resize_shorter`` of the shorter
  side (offsets ``(size - c + 1) // 2``), resized to crop x crop, then normalised.

``interpolation`` (bilinear or bicubic), ``mean_rgb`` and ``stddev_rgb`` (on the 0-255 pixel
scale, tensorflow/tpu's names) come from the config too; the defaults are ResNet-50's.

Input checks happen before any pixel is decoded where they can: the format is told from
the file's magic bytes (JPEG and PNG only), and the size is read from the header, so an
oversized image is refused without allocating its pixels.
"""

from __future__ import annotations

import io
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from contract.errors import ConfigError, InputError
from contract.prose import pillow_truncated

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
DEFAULT_RESIZE = 256
DEFAULT_CROP = 224
DEFAULT_MAX_MEGAPIXELS = 40.0
RESIZE_MODES = ("resize_then_crop", "crop_then_resize")
INTERPOLATIONS = ("bilinear", "bicubic")

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_MAGIC = b"\xff\xd8\xff"
# Formats we recognise only to say clearly that they are not accepted.
_OTHER_MAGIC = ((b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))
NOT_AN_IMAGE = "not a decodable image (JPEG/PNG expected)"


@dataclass(frozen=True)
class PreprocessOptions:
    resize: int = DEFAULT_RESIZE  # shorter side after resizing
    crop: int = DEFAULT_CROP  # square centre crop
    max_megapixels: float = DEFAULT_MAX_MEGAPIXELS  # width x height limit, checked from the header
    resize_mode: str = "resize_then_crop"  # or "crop_then_resize" (RESIZE_MODES)
    interpolation: str = "bilinear"  # or "bicubic"
    # Per channel on the 0-1 scale (pixel / 255): (pixel / 255 - mean) / std.
    mean: tuple[float, ...] = tuple(float(v) for v in IMAGENET_MEAN)
    std: tuple[float, ...] = tuple(float(v) for v in IMAGENET_STD)

    def __post_init__(self):
        if self.crop < 1 or self.resize < self.crop:
            raise ConfigError(f"need 1 <= crop ({self.crop}) <= resize ({self.resize})")
        if not self.max_megapixels > 0:
            raise ConfigError(f"max_megapixels must be > 0, got {self.max_megapixels}")
        if self.resize_mode not in RESIZE_MODES:
            raise ConfigError(f"resize_mode must be one of {', '.join(RESIZE_MODES)}, got {self.resize_mode!r}")
        if self.interpolation not in INTERPOLATIONS:
            raise ConfigError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got {self.interpolation!r}")
        if len(self.mean) != 3 or len(self.std) != 3 or not all(s > 0 for s in self.std):
            raise ConfigError(f"need 3 mean values and 3 positive std values, got {self.mean} and {self.std}")
        # Kept as the float32 values the arithmetic uses, so equal recipes compare equal.
        object.__setattr__(self, "mean", tuple(float(np.float32(v)) for v in self.mean))
        object.__setattr__(self, "std", tuple(float(np.float32(v)) for v in self.std))

    @property
    def mean_array(self) -> np.ndarray:
        return np.asarray(self.mean, dtype=np.float32)

    @property
    def std_array(self) -> np.ndarray:
        return np.asarray(self.std, dtype=np.float32)

    @property
    def max_pixels(self) -> int:
        return int(self.max_megapixels * 1_000_000)

    @classmethod
    def from_config(cls, config) -> PreprocessOptions:
        """Read ``resize_shorter``, ``resize_mode``, ``interpolation``, ``mean_rgb``,
        ``stddev_rgb`` (three numbers each, 0-255 scale) and ``max_megapixels`` from
        parameters; the crop from the ``pixel_values`` output dims [3, crop, crop]
        (contract.model_config.ModelConfig)."""
        dims = config.output("pixel_values").dims
        if len(dims) != 3 or dims[0] != 3 or dims[1] != dims[2] or dims[1] < 1:
            raise ConfigError(f"model {config.name!r}: output 'pixel_values' must have dims [3, S, S], config says {list(dims)}")
        raw = config.param("max_megapixels")
        try:
            megapixels = DEFAULT_MAX_MEGAPIXELS if raw is None else float(raw)
        except ValueError:
            raise ConfigError(f"model {config.name!r}: parameter 'max_megapixels' must be a number, got {raw!r}") from None
        return cls(
            resize=config.param_int("resize_shorter", DEFAULT_RESIZE, minimum=1),
            crop=dims[1],
            max_megapixels=megapixels,
            resize_mode=config.param("resize_mode", "resize_then_crop"),
            interpolation=config.param("interpolation", "bilinear"),
            mean=_rgb(config, "mean_rgb", cls.mean),
            std=_rgb(config, "stddev_rgb", cls.std),
        )


def _rgb(config, key: str, default: tuple[float, ...]) -> tuple[float, ...]:
    """Three comma-separated numbers on the 0-255 scale -> the 0-1 scale (divided in float64,
    so "123.675,116.28,103.53" gives exactly torchvision's float32 0.485, 0.456, 0.406)."""
    raw = config.param(key)
    if raw is None:
        return default
    try:
        values = tuple(float(v) / 255.0 for v in raw.split(","))
    except ValueError:
        raise ConfigError(f"model {config.name!r}: parameter {key!r} must be three numbers, got {raw!r}") from None
    if len(values) != 3:
        raise ConfigError(f"model {config.name!r}: parameter {key!r} must be three numbers (R,G,B), got {raw!r}")
    return values


def _format_of(data: bytes) -> str | None:
    if data.startswith(_JPEG_MAGIC):
        return "JPEG"
    if data.startswith(_PNG_MAGIC):
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    for magic, name in _OTHER_MAGIC:
        if data.startswith(magic):
            return name
    return None


def _megapixels(pixels: int) -> str:
    return f"{pixels / 1e6:.1f}"


def _check_size(field: str, width: int, height: int, options: PreprocessOptions) -> None:
    if width <= 0 or height <= 0:
        raise InputError(field, f"image has zero size ({width}x{height} pixels)")
    if width * height > options.max_pixels:
        raise InputError(
            field, f"{width}x{height} = {_megapixels(width * height)} MP exceeds the {options.max_megapixels:g} MP limit"
        )
    if options.resize_mode == "crop_then_resize":
        return  # the crop is resized to crop x crop whatever the aspect ratio
    # The shorter side is scaled to `resize` before cropping, so a tiny but extremely long
    # image (1 x 10000 pixels) would become 256 x 2,560,000. Same limit for the resized image.
    new_w, new_h = resized_size(width, height, options.resize)
    if new_w * new_h > options.max_pixels:
        raise InputError(
            field,
            f"{width}x{height} would be resized to {new_w}x{new_h} = {_megapixels(new_w * new_h)} MP before cropping, "
            f"over the {options.max_megapixels:g} MP limit: aspect ratio too extreme",
        )


def to_rgb(image):
    """Any PIL mode -> RGB. 16-bit greyscale is scaled (PIL's convert would clip it to white)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode.startswith("I;16") or image.mode == "I":
        wide: np.ndarray = np.asarray(image, dtype=np.uint32 if image.mode == "I" else np.uint16)
        image = Image.fromarray(np.clip(wide >> 8, 0, 255).astype(np.uint8), mode="L")
    with warnings.catch_warnings():
        # "Palette images with Transparency expressed in bytes should be converted to RGBA"
        warnings.simplefilter("ignore", UserWarning)
        # Alpha is dropped as torchvision's loader does (.convert("RGB")), not composited.
        return image.convert("RGB")


def decode_image(data: bytes, field: str, options: PreprocessOptions = PreprocessOptions()):
    """Validated bytes -> RGB ``PIL.Image``. Raises InputError naming ``field`` and the rule."""
    from PIL import ImageFile, JpegImagePlugin, PngImagePlugin

    if len(data) == 0:
        raise InputError(field, "empty (0 bytes); a JPEG or PNG file was expected")
    kind = _format_of(data)
    if kind is None:
        raise InputError(field, NOT_AN_IMAGE)
    if kind not in ("JPEG", "PNG"):
        raise InputError(field, f"{kind} images are not accepted (JPEG/PNG expected)")
    if kind == "PNG" and len(data) >= 24 and data[12:16] == b"IHDR":
        # PIL refuses a zero-sized PNG with a generic error; read the header ourselves first.
        width, height = struct.unpack(">II", data[16:24])
        _check_size(field, width, height, options)
    try:
        # The format's own class parses the header only. Image.open would do the same plus a
        # global decompression-bomb check of its own; ours, below, is the configured one.
        image: ImageFile.ImageFile
        if kind == "PNG":
            image = PngImagePlugin.PngImageFile(io.BytesIO(data))
        else:
            image = JpegImagePlugin.JpegImageFile(io.BytesIO(data))
    except (OSError, SyntaxError, ValueError, struct.error, IndexError) as exc:
        if pillow_truncated(str(exc)):
            raise InputError(field, f"truncated {kind} file ({len(data)} bytes): header incomplete") from None
        raise InputError(field, f"{NOT_AN_IMAGE}: corrupt {kind} header ({exc})") from None
    _check_size(field, *image.size, options)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, struct.error, IndexError) as exc:
        reason = str(exc)
        if pillow_truncated(reason):
            raise InputError(field, f"truncated {kind} file ({len(data)} bytes): {reason}") from None
        raise InputError(field, f"corrupt {kind} data: {reason}") from None
    return to_rgb(image)


def resized_size(width: int, height: int, shorter: int) -> tuple[int, int]:
    """torchvision's Resize(int) output (width, height): shorter side = ``shorter``, the other
    truncated, never rounded."""
    if width <= height:
        return shorter, int(shorter * height / width)
    return int(shorter * width / height), shorter


def center_crop_box(width: int, height: int, crop: int) -> tuple[int, int]:
    """(left, top) of torchvision's CenterCrop: ``int(round((size - crop) / 2))``."""
    return int(round((width - crop) / 2.0)), int(round((height - crop) / 2.0))


def center_square(width: int, height: int, crop: int, resize: int) -> tuple[int, int, int]:
    """(left, top, side) of tensorflow/tpu's eval crop: side = int(crop / resize * shorter side),
    offsets ``(size - side + 1) // 2``."""
    side = max(1, int((crop / resize) * min(width, height)))
    return (width - side + 1) // 2, (height - side + 1) // 2, side


def to_pixel_values(image, options: PreprocessOptions = PreprocessOptions()) -> np.ndarray:
    """RGB PIL image -> [3, crop, crop] float32, normalised with the options' mean and std."""
    from PIL import Image

    if image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode}")
    resample = Image.Resampling.BICUBIC if options.interpolation == "bicubic" else Image.Resampling.BILINEAR
    width, height = image.size
    if options.resize_mode == "crop_then_resize":
        left, top, side = center_square(width, height, options.crop, options.resize)
        box = (left, top, left + side, top + side)
        pixels = np.asarray(image.resize((options.crop, options.crop), resample, box=box))
    else:
        width, height = resized_size(width, height, options.resize)
        if (width, height) != image.size:
            image = image.resize((width, height), resample)
        left, top = center_crop_box(width, height, options.crop)
        pixels = np.asarray(image)[top : top + options.crop, left : left + options.crop]
    scaled = pixels.astype(np.float32) / np.float32(255.0)
    normalised = (scaled - options.mean_array) / options.std_array
    return np.ascontiguousarray(normalised.transpose(2, 0, 1))


def preprocess(values: np.ndarray | Sequence[bytes], field: str, options: PreprocessOptions = PreprocessOptions()) -> np.ndarray:
    """One request's images (numpy object array of encoded bytes, any shape) -> [n, 3, crop, crop].

    The first bad element raises InputError naming it (``IMAGE[2]: ...``): a request fails
    or succeeds whole.
    """
    flat = np.asarray(values, dtype=object).reshape(-1)
    out = np.empty((len(flat), 3, options.crop, options.crop), dtype=np.float32)
    for index, value in enumerate(flat):
        name = f"{field}[{index}]"
        if isinstance(value, (bytes, bytearray, np.bytes_)):
            data = bytes(value)
        else:
            raise InputError(name, f"expected encoded image bytes, got {type(value).__name__}")
        out[index] = to_pixel_values(decode_image(data, name, options), options)
    return out
