"""export/resnet.py: torchvision's ResNet-50 layout, weights loading, BatchNorm recalibration."""

import numpy as np
import pytest
import torch

from export import resnet

# A sample of torchvision resnet50().state_dict() keys, in torchvision's order.
TORCHVISION_KEYS = [
    "conv1.weight",
    "bn1.weight",
    "bn1.bias",
    "bn1.running_mean",
    "bn1.running_var",
    "bn1.num_batches_tracked",
    "layer1.0.conv1.weight",
    "layer1.0.bn1.weight",
    "layer1.0.conv2.weight",
    "layer1.0.conv3.weight",
    "layer1.0.bn3.running_var",
    "layer1.0.downsample.0.weight",
    "layer1.0.downsample.1.weight",
    "layer1.0.downsample.1.num_batches_tracked",
    "layer1.2.bn3.bias",
    "layer2.0.downsample.0.weight",
    "layer2.3.conv3.weight",
    "layer3.5.bn2.running_mean",
    "layer4.0.downsample.1.running_var",
    "layer4.2.bn3.num_batches_tracked",
    "fc.weight",
    "fc.bias",
]
SHAPES = {
    "conv1.weight": (64, 3, 7, 7),
    "layer1.0.conv1.weight": (64, 64, 1, 1),
    "layer1.0.conv3.weight": (256, 64, 1, 1),
    "layer2.0.conv2.weight": (128, 128, 3, 3),
    "layer2.0.downsample.0.weight": (512, 256, 1, 1),
    "layer4.2.conv3.weight": (2048, 512, 1, 1),
    "fc.weight": (1000, 2048),
    "fc.bias": (1000,),
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return resnet.ResNet50()


def test_state_dict_matches_torchvision(model):
    state = model.state_dict()
    # 53 convolutions + 53 BatchNorms x 5 entries (weight, bias, running mean/var,
    # num_batches_tracked) + fc weight and bias = 53 + 265 + 2.
    assert len(state) == 320
    keys = list(state)
    assert [k for k in keys if k in TORCHVISION_KEYS] == TORCHVISION_KEYS  # present, same order
    for key, shape in SHAPES.items():
        assert tuple(state[key].shape) == shape, key
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's resnet50 count
    assert not any("downsample" in k for k in keys if k.startswith(("layer1.1", "layer2.1", "layer3.1", "layer4.1")))


def test_stride_is_on_the_3x3_convolution(model):
    """ResNet v1.5 (torchvision): the downsampling block strides in conv2, not conv1."""
    block = model.layer2[0]
    assert block.conv1.stride == (1, 1) and block.conv2.stride == (2, 2)
    assert block.downsample[0].stride == (2, 2)


def test_weights_load_strictly(model, tmp_path):
    path = tmp_path / "resnet50.pth"
    torch.save(model.state_dict(), path)
    other = resnet.ResNet50()
    resnet.load_weights(other, path)
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    # wrapped in a training checkpoint
    torch.save({"state_dict": model.state_dict(), "epoch": 90}, tmp_path / "ckpt.pth")
    resnet.load_weights(resnet.ResNet50(), tmp_path / "ckpt.pth")
    # a missing key fails (strict=True)
    state = model.state_dict()
    del state["fc.bias"]
    torch.save(state, tmp_path / "broken.pth")
    with pytest.raises(RuntimeError, match="fc.bias"):
        resnet.load_weights(resnet.ResNet50(), tmp_path / "broken.pth")


def test_build_with_weights_records_provenance(model, tmp_path):
    path = tmp_path / "resnet50.pth"
    torch.save(model.state_dict(), path)
    built, meta = resnet.build(weights=path)
    assert not built.training
    assert meta["provenance"] == "pretrained" and meta["weights_file"] == "resnet50.pth" and len(meta["weights_sha256"]) == 64
    with pytest.raises(ValueError, match="calibration"):
        resnet.build(weights=None)


def test_seeded_init_is_deterministic():
    torch.manual_seed(resnet.DEFAULT_SEED)
    a = resnet.ResNet50().state_dict()
    torch.manual_seed(resnet.DEFAULT_SEED)
    b = resnet.ResNet50().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert float(a["conv1.weight"].std()) == pytest.approx((2 / (64 * 7 * 7)) ** 0.5, rel=0.05)  # kaiming fan_out


def test_batchnorm_recalibration_normalises_and_restores():
    """Small input so the test stays quick: the statistics are re-estimated on it, momenta
    come back, and the model ends in eval mode."""
    torch.manual_seed(0)
    net = resnet.ResNet50()
    rng = np.random.default_rng(0)
    batches = [torch.from_numpy(rng.normal(0.5, 1.0, (4, 3, 64, 64)).astype(np.float32)) for _ in range(2)]
    seen = resnet.recalibrate_batchnorm(net, batches)
    assert seen == 8 and not net.training
    assert net.bn1.momentum == 0.1 and int(net.bn1.num_batches_tracked) == 2
    # conv1's output statistics over the calibration data are what bn1 recorded
    with torch.no_grad():
        out = torch.cat([net.conv1(b) for b in batches])
    np.testing.assert_allclose(net.bn1.running_mean.numpy(), out.mean(dim=(0, 2, 3)).numpy(), rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError, match="no calibration images"):
        resnet.recalibrate_batchnorm(net, [])
