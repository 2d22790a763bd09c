"""Image decoding and preprocessing (python_backends.image.preprocess): what is accepted, what
is refused with which message, and that the pixels equal torchvision's recipe."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from contract.errors import ConfigError, InputError
from contract.model_config import ModelConfig
from python_backends.image.preprocess import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    PreprocessOptions,
    center_crop_box,
    decode_image,
    preprocess,
    resized_size,
    to_pixel_values,
)


def photo(width=320, height=240, seed=0) -> np.ndarray:
    """A smooth colour gradient with noise: RGB uint8 [h, w, 3]."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    return np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)


def encode(array_or_image, fmt="PNG", **kw) -> bytes:
    image = array_or_image if isinstance(array_or_image, Image.Image) else Image.fromarray(array_or_image)
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG signature and IHDR chunk declaring width x height, and no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk


def test_png_decodes_losslessly_and_jpeg_closely():
    array = photo()
    png = decode_image(encode(array, "PNG"), "IMAGE[0]")
    assert png.mode == "RGB" and png.size == (320, 240)
    np.testing.assert_array_equal(np.asarray(png), array)
    jpeg = decode_image(encode(array, "JPEG", quality=95), "IMAGE[0]")
    assert jpeg.size == (320, 240)
    assert np.abs(np.asarray(jpeg).astype(int) - array).mean() < 6


def test_pixel_values_shape_dtype_and_normalisation():
    out = preprocess(np.array([[encode(photo(), "PNG")], [encode(photo(500, 375), "JPEG")]], dtype=object), "IMAGE")
    assert out.shape == (2, 3, 224, 224) and out.dtype == np.float32 and out.flags["C_CONTIGUOUS"]
    # a uniform image maps to exactly (v/255 - mean) / std per channel
    grey = to_pixel_values(Image.new("RGB", (300, 260), (128, 64, 255)))
    expected = (np.array([128, 64, 255], dtype=np.float32) / np.float32(255) - IMAGENET_MEAN) / IMAGENET_STD
    np.testing.assert_array_equal(grey[:, 100, 100], expected)


@pytest.mark.parametrize(
    "size, resized, box",
    [
        ((500, 375), (341, 256), (58, 16)),  # (341 - 224) / 2 = 58.5 rounds to even: 58
        ((375, 500), (256, 341), (16, 58)),
        ((256, 256), (256, 256), (16, 16)),
        ((100, 1000), (256, 2560), (16, 1168)),  # upscaled: the shorter side is always 256
        ((1000, 999), (256, 256), (16, 16)),  # 256 * 1000 / 999 = 256.26, truncated like torchvision
    ],
)
def test_resize_and_crop_geometry_follow_torchvision(size, resized, box):
    assert resized_size(*size, 256) == resized
    assert center_crop_box(*resized, 224) == box


def test_pixels_match_an_independent_antialiased_bilinear_resize():
    """torch's antialiased bilinear resize is built to match PIL's: within one grey level."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    for width, height in ((451, 300), (300, 451), (120, 90), (1000, 700)):
        image = Image.fromarray(photo(width, height, seed=width))
        ours = to_pixel_values(image)
        t = torch.from_numpy(np.asarray(image).astype(np.float32)).permute(2, 0, 1)[None]
        new_w, new_h = resized_size(width, height, 256)
        r = F.interpolate(t, size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False)[0]
        left, top = center_crop_box(new_w, new_h, 224)
        r = r.round().clamp(0, 255)[:, top : top + 224, left : left + 224].numpy() / 255.0
        levels = np.abs((ours * IMAGENET_STD[:, None, None] + IMAGENET_MEAN[:, None, None]) - r) * 255
        assert levels.max() <= 1.0 + 1e-3, (width, height, levels.max())
        assert levels.mean() < 0.3


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "P", "1"])
def test_other_modes_become_rgb(mode):
    image = Image.fromarray(photo(64, 48)).convert(mode)
    decoded = decode_image(encode(image, "PNG"), "IMAGE[0]")
    assert decoded.mode == "RGB" and decoded.size == (64, 48)
    if mode in ("L", "LA"):
        rgb = np.asarray(decoded)
        assert (rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all()
        np.testing.assert_array_equal(rgb[..., 0], np.asarray(image.convert("L")))


def test_rgba_keeps_colour_and_drops_alpha_like_torchvision():
    array = photo(64, 48)
    rgba = np.dstack([array, np.full((48, 64), 0, np.uint8)])  # fully transparent
    decoded = decode_image(encode(rgba, "PNG"), "IMAGE[0]")
    np.testing.assert_array_equal(np.asarray(decoded), array)


def test_16_bit_greyscale_is_scaled_not_clipped():
    wide = (np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 16).astype(np.uint16)
    image = Image.fromarray(wide)
    assert image.mode.startswith("I;16")
    decoded = np.asarray(decode_image(encode(image, "PNG"), "IMAGE[0]"))
    np.testing.assert_array_equal(decoded[..., 0], (wide >> 8).astype(np.uint8))
    assert decoded.min() == 0 and 100 < decoded.mean() < 155  # PIL's own convert would be all 255


def test_cmyk_jpeg_becomes_rgb():
    image = Image.new("CMYK", (40, 30), (0, 255, 255, 0))  # red
    decoded = decode_image(encode(image, "JPEG", quality=95), "IMAGE[0]")
    r, g, b = np.asarray(decoded)[15, 20].astype(int)
    assert decoded.mode == "RGB" and r > 200 and g < 60 and b < 60


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_files_are_refused(fmt):
    data = encode(photo(), fmt)
    with pytest.raises(InputError, match=rf"^IMAGE\[0\]: truncated {fmt} file \({len(data) // 2} bytes\)"):
        decode_image(data[: len(data) // 2], "IMAGE[0]")


def test_truncated_inside_the_header():
    data = encode(photo(), "JPEG")[:40]
    with pytest.raises(InputError, match=r"^IMAGE\[0\]: truncated JPEG file \(40 bytes\)"):
        decode_image(data, "IMAGE[0]")


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", r"^IMAGE\[0\]: empty \(0 bytes\); a JPEG or PNG file was expected$"),
        (np.random.default_rng(1).bytes(5000), r"^IMAGE\[0\]: not a decodable image \(JPEG/PNG expected\)$"),
        (b"hello, world", r"^IMAGE\[0\]: not a decodable image \(JPEG/PNG expected\)$"),
        (
            b"\x89PNG\r\n\x1a\n" + np.random.default_rng(2).bytes(100),
            r"^IMAGE\[0\]: not a decodable image \(JPEG/PNG expected\): corrupt PNG header",
        ),
        (b"GIF89a" + bytes(40), r"^IMAGE\[0\]: GIF images are not accepted \(JPEG/PNG expected\)$"),
        (b"RIFF\x00\x00\x00\x00WEBPVP8 ", r"^IMAGE\[0\]: WEBP images are not accepted"),
    ],
    ids=["empty", "random-bytes", "text", "png-magic-then-garbage", "gif", "webp"],
)
def test_not_an_image(data, message):
    with pytest.raises(InputError, match=message):
        decode_image(data, "IMAGE[0]")


def test_real_gif_and_bmp_are_refused_by_name():
    for fmt in ("GIF", "BMP"):
        with pytest.raises(InputError, match=rf"{fmt} images are not accepted"):
            decode_image(encode(photo(32, 32), fmt), "IMAGE[0]")


@pytest.mark.parametrize("width, height", [(0, 5), (7, 0)])
def test_zero_size_image(width, height):
    with pytest.raises(InputError, match=rf"^IMAGE\[0\]: image has zero size \({width}x{height} pixels\)$"):
        decode_image(png_header_only(width, height), "IMAGE[0]")


def test_pixel_limit_is_checked_from_the_header_before_decoding():
    # 144 MP declared, ~50 bytes sent: decoding would fail as truncated, so this message
    # proves the size was refused from the header alone.
    with pytest.raises(InputError, match=r"^IMAGE\[0\]: 12000x12000 = 144.0 MP exceeds the 40 MP limit$"):
        decode_image(png_header_only(12000, 12000), "IMAGE[0]")
    # beyond PIL's own decompression-bomb limit (179 MP): still our message, not PIL's error
    with pytest.raises(InputError, match=r"^IMAGE\[0\]: 20000x20000 = 400.0 MP exceeds the 40 MP limit$"):
        decode_image(png_header_only(20000, 20000), "IMAGE[0]")


def test_extreme_aspect_ratio_is_refused_before_resizing():
    """1 x 10000 is small, but scaling its shorter side to 256 would make it 655 MP."""
    line = encode(np.zeros((10000, 1, 3), np.uint8), "PNG")
    with pytest.raises(
        InputError,
        match=r"^IMAGE\[0\]: 1x10000 would be resized to 256x2560000 = 655.4 MP before cropping, "
        r"over the 40 MP limit: aspect ratio too extreme$",
    ):
        decode_image(line, "IMAGE[0]")
    assert decode_image(encode(np.zeros((2000, 20, 3), np.uint8), "PNG"), "IMAGE[0]").size == (20, 2000)  # 100:1 is fine


def test_pixel_limit_is_configurable_and_applies_to_jpeg():
    small = PreprocessOptions(max_megapixels=0.05)
    data = encode(photo(320, 240), "JPEG")  # 0.0768 MP
    with pytest.raises(InputError, match=r"^IMAGE\[0\]: 320x240 = 0.1 MP exceeds the 0.05 MP limit$"):
        decode_image(data, "IMAGE[0]", small)
    assert decode_image(data, "IMAGE[0]", PreprocessOptions(max_megapixels=0.1)).size == (320, 240)


def test_a_bad_element_is_named_and_fails_the_request():
    good = encode(photo(), "PNG")
    values = np.array([[good], [good], [b"not an image"]], dtype=object)
    with pytest.raises(InputError, match=r"^IMAGE\[2\]: not a decodable image"):
        preprocess(values, "IMAGE")
    with pytest.raises(InputError, match=r"^IMAGE\[0\]: expected encoded image bytes, got int"):
        preprocess(np.array([[3]], dtype=object), "IMAGE")


def _config(**params) -> ModelConfig:
    return ModelConfig(
        {
            "name": "image_preprocess",
            "input": [{"name": "IMAGE", "data_type": "TYPE_STRING", "dims": ["1"]}],
            "output": [{"name": "pixel_values", "data_type": "TYPE_FP32", "dims": params.pop("dims", ["3", "224", "224"])}],
            "parameters": {k: {"string_value": v} for k, v in params.items()},
        }
    )


def test_options_from_config():
    options = PreprocessOptions.from_config(_config(resize_shorter="288", max_megapixels="12.5", dims=["3", "256", "256"]))
    assert (options.resize, options.crop, options.max_megapixels, options.max_pixels) == (288, 256, 12.5, 12_500_000)
    assert PreprocessOptions.from_config(_config()) == PreprocessOptions()
    with pytest.raises(ConfigError, match="max_megapixels"):
        PreprocessOptions.from_config(_config(max_megapixels="lots"))
    with pytest.raises(ConfigError, match=r"must be > 0"):
        PreprocessOptions.from_config(_config(max_megapixels="0"))
    with pytest.raises(ConfigError, match=r"crop \(224\) <= resize \(200\)"):
        PreprocessOptions.from_config(_config(resize_shorter="200"))
    with pytest.raises(ConfigError, match=r"dims \[3, S, S\]"):
        PreprocessOptions.from_config(_config(dims=["224", "224", "3"]))
