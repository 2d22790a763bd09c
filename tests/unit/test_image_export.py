"""Export of the image classifiers: parity gate, manifest and provenance, idempotence, weights;
INT8/FP16 builders on a small graph."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from export import image_classifier, image_data, image_quant
from export.variants import check_gate

# ResNet-50 without --weights: the random-init path (image_classification_resnet50). The
# default model, EfficientNet-Lite0 with its packaged weights, is exported at the end.
RN = image_classifier.RESNET50


@pytest.fixture(scope="module")
def exported_with_logits(tmp_path_factory):
    """(repo, result, ort): the export, and what its parity check ran through ONNX Runtime
    (model path, pixels, logits), recorded so a test reads the exported graph's logits without
    running the 192 evaluation photos through ResNet-50 again."""
    repo = tmp_path_factory.mktemp("repo")
    ort: list[tuple[Path, np.ndarray, np.ndarray]] = []
    run = image_classifier.ort_logits

    def recorded(model_path, pixels, batch_size=16):
        logits = run(model_path, pixels, batch_size)
        ort.append((Path(model_path), pixels, logits))
        return logits

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(image_classifier, "ort_logits", recorded)
        result = image_classifier.export(repo, model=RN)
    return repo, result, ort


@pytest.fixture(scope="module")
def exported(exported_with_logits):
    return exported_with_logits[:2]


def test_export_writes_model_labels_and_manifest(exported):
    repo, result = exported
    assert not result.skipped
    assert result.max_abs_diff is not None and result.max_abs_diff <= image_classifier.MAX_ABS_DIFF
    assert result.top1_agreement == 1.0
    model_path, labels_path = image_classifier.paths(repo, RN)
    assert labels_path.read_bytes() == image_classifier.LABELS.read_bytes()
    manifest = json.loads(model_path.with_suffix(".export.json").read_text())
    assert manifest["provenance"] == "random-init(seed=0)+bn-recalibrated" == result.provenance
    assert manifest["weights"]["bn_calibration_images"] == 64
    assert manifest["source"] == image_classifier.source_fingerprint(None, RN)
    assert manifest["max_abs_diff"] == result.max_abs_diff and manifest["evaluation_images"] == image_data.EVALUATION_SIZE


def test_exported_graph_has_named_tensors_and_a_dynamic_batch(exported):
    repo, _ = exported
    model = onnx.load(str(image_classifier.paths(repo, RN)[0]), load_external_data=False)
    dims = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]  # noqa: E731
    assert {i.name: dims(i) for i in model.graph.input} == {"pixel_values": ["batch", 3, 224, 224]}
    assert {o.name: dims(o) for o in model.graph.output} == {"logits": ["batch", 1000]}
    assert model.opset_import[0].version == image_classifier.OPSET


def test_random_logits_depend_on_the_image(exported_with_logits):
    """BatchNorm recalibration is what makes an untrained network's outputs input-dependent
    (the exported graph's logits on the evaluation photos, as the export's parity check got them)."""
    repo, _, ort = exported_with_logits
    ((model_path, pixels, logits),) = ort
    assert model_path == image_classifier.paths(repo, RN)[0]
    assert np.array_equal(pixels, image_data.pixel_values(image_data.evaluation_set()))
    assert logits.std(axis=0).mean() > 0.1  # across images, per class
    assert len(set(logits.argmax(axis=1))) >= 4


def test_second_export_is_skipped_until_something_changes(exported):
    repo, _ = exported
    assert image_classifier.up_to_date(repo, model=RN)
    assert image_classifier.export(repo, model=RN).skipped
    model_path, labels_path = image_classifier.paths(repo, RN)
    original = labels_path.read_bytes()
    labels_path.write_bytes(original + b"extra\n")
    assert not image_classifier.up_to_date(repo, model=RN)
    labels_path.write_bytes(original)
    assert image_classifier.up_to_date(repo, model=RN)
    # other weights are another source
    assert not image_classifier.up_to_date(repo, weights=image_classifier.LABELS, model=RN)


def test_gate_rejects_an_export_that_misses_its_tolerance(tmp_path, monkeypatch):
    monkeypatch.setattr(image_classifier, "MAX_ABS_DIFF", 0.0)
    with pytest.raises(RuntimeError, match="export rejected"):
        image_classifier.export(tmp_path, model=RN)
    assert not image_classifier.paths(tmp_path, RN)[0].exists()
    assert not image_classifier.up_to_date(tmp_path, model=RN)


def test_parity_check_measures_a_real_difference(exported, tmp_path):
    """A corrupted graph must fail parity (the check cannot pass vacuously)."""
    from onnx import numpy_helper

    repo, _ = exported
    model = onnx.load(str(image_classifier.paths(repo, RN)[0]))
    fc = next(t for t in model.graph.initializer if list(t.dims) == [1000, 2048])
    array = numpy_helper.to_array(fc).copy()
    array[:, :1024] *= -1
    fc.CopyFrom(numpy_helper.from_array(array, fc.name))
    broken = tmp_path / "broken.onnx"
    onnx.save(model, str(broken))
    parity = image_classifier.check_parity(broken, model=RN)
    assert parity.max_abs_diff > 0.1 and parity.top1_agreement < 0.9 and parity.top1_disagreements > 0


def test_compare_forgives_only_ties():
    expected = np.array([[1.0, 1.00001, 0.0], [3.0, 0.0, 0.0]])
    got = np.array([[1.00001, 1.0, 0.0], [0.0, 3.0, 0.0]])
    parity = image_classifier.compare(expected, got, tolerance=1e-3)
    assert parity.top1_agreement == 0.0 and parity.top1_disagreements == 1 and parity.images == 2


def test_export_with_weights_records_them(exported, tmp_path, monkeypatch):
    # What is checked here is the record and the skip / force logic, not the parity figures (the
    # fixture's export has the full check): the weights file's network, a new one whose PyTorch
    # logits are not cached, is checked on the first 16 evaluation photos instead of all 192.
    photos = image_classifier.evaluation_pixels
    monkeypatch.setattr(image_classifier, "evaluation_pixels", lambda model=RN: photos(model)[:16])
    model, _ = image_classifier.load_torch_model(None, RN)
    weights = tmp_path / "resnet50.pth"
    torch.save(model.state_dict(), weights)
    repo = tmp_path / "repo"
    result = image_classifier.export(repo, weights=weights, model=RN)
    assert result.provenance == "pretrained" and result.top1_agreement == 1.0
    manifest = json.loads(image_classifier.paths(repo, RN)[0].with_suffix(".export.json").read_text())
    assert manifest["weights"]["weights_file"] == "resnet50.pth"
    assert manifest["source"]["weights"]["sha256"] == manifest["weights"]["weights_sha256"]
    assert image_classifier.up_to_date(repo, weights=weights, model=RN)
    # A later plain export (make serve / make test) keeps the trained model...
    assert image_classifier.up_to_date(repo, model=RN)
    kept = image_classifier.export(repo, model=RN)
    assert kept.skipped and kept.provenance == "pretrained"
    # ...and only --force without --weights goes back to the random initialisation (a rebuild,
    # after which the plain export is up to date again).
    forced = image_classifier.export(repo, force=True, model=RN)
    assert not forced.skipped and forced.provenance.startswith("random-init")
    assert image_classifier.up_to_date(repo, model=RN)


# ---- INT8 / FP16 builders, on a small CNN so they run in seconds ---------------------------


@pytest.fixture(scope="module")
def small_cnn(tmp_path_factory):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    ).eval()
    path = tmp_path_factory.mktemp("cnn") / "model.onnx"
    torch.onnx.export(
        net,
        (torch.zeros(2, 3, 32, 32),),
        str(path),
        input_names=["pixel_values"],
        output_names=["logits"],
        dynamic_axes={"pixel_values": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    rng = np.random.default_rng(0)
    calibration = rng.normal(0, 1, (16, 3, 32, 32)).astype(np.float32)
    evaluation = rng.normal(0, 1, (16, 3, 32, 32)).astype(np.float32)
    return path, calibration, evaluation


def test_int8_is_static_qdq_per_channel_and_close(small_cnn, tmp_path):
    src, calibration, evaluation = small_cnn
    dst = tmp_path / "model.int8.onnx"
    image_quant.quantize_int8(src, dst, calibration=calibration)
    graph = onnx.load(str(dst)).graph
    ops = [n.op_type for n in graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    assert not any(op in ops for op in ("DynamicQuantizeLinear", "ConvInteger"))  # static, not dynamic
    inits = {t.name: t for t in graph.initializer}
    per_channel = [
        n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[1] in inits and list(inits[n.input[1]].dims) == [32]
    ]
    assert per_channel, "the 32-channel convolution's weights should have one scale per channel"
    reference = image_quant.run_logits(src, evaluation)
    metrics = image_quant.agreement(reference, image_quant.run_logits(dst, evaluation))
    assert metrics["max_abs_logit_diff"] < 0.05 * np.abs(reference).max()


def _conv_weights(path):
    """{Conv/Gemm node name: its quantized weight array} of a QDQ graph."""
    graph = onnx.load(str(path)).graph
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    return {n.name: inits[producers[n.input[1]].input[0]] for n in graph.node if n.op_type in ("Conv", "Gemm")}


def test_int8_weights_take_7_bits_without_vnni(small_cnn, tmp_path):
    # ONNX Runtime's u8 x s8 kernels on x86 without VNNI add pairs of products in int16:
    # 2 * 255 * 127 overflows it, 2 * 255 * 64 does not.
    src, calibration, _ = small_cnn
    full, reduced = tmp_path / "full.onnx", tmp_path / "reduced.onnx"
    image_quant.quantize_int8(src, full, calibration=calibration, bias_correction=False, has_vnni=True)
    image_quant.quantize_int8(src, reduced, calibration=calibration, bias_correction=False, has_vnni=False)
    full_max = max(int(np.abs(w.astype(np.int32)).max()) for w in _conv_weights(full).values())
    reduced_max = max(int(np.abs(w.astype(np.int32)).max()) for w in _conv_weights(reduced).values())
    assert full_max >= 127 and reduced_max <= 64


def test_bias_correction_cancels_the_mean_shift_of_weight_rounding(small_cnn, tmp_path):
    src, calibration, _ = small_cnn
    quantized, corrected = tmp_path / "q.onnx", tmp_path / "corrected.onnx"
    image_quant.quantize_int8(src, quantized, calibration=calibration, bias_correction=False, has_vnni=True)
    assert image_quant.correct_biases(src, quantized, corrected, calibration) == 3  # two Convs and the Gemm
    dequantized = image_quant._dequantized_weights(onnx.load(str(quantized)))

    def rounded(biases_from):
        # The float graph with the quantized model's weights: weight rounding alone.
        model, bias_model = onnx.load(str(src)), onnx.load(str(biases_from))
        biases = {t.name: t for t in bias_model.graph.initializer}
        inits = {t.name: t for t in model.graph.initializer}
        for node in model.graph.node:
            if node.name in dequantized:
                inits[node.input[1]].CopyFrom(
                    onnx.numpy_helper.from_array(dequantized[node.name].astype(np.float32), node.input[1])
                )
                inits[node.input[2]].CopyFrom(biases[node.input[2]])
        return model

    first_conv = next(n for n in onnx.load(str(src)).graph.node if n.op_type == "Conv").output[0]
    reference = image_quant.input_means(onnx.load(str(src)), [first_conv, "logits"], calibration)
    before = image_quant.input_means(rounded(src), [first_conv, "logits"], calibration)
    after = image_quant.input_means(rounded(corrected), [first_conv, "logits"], calibration)
    for name in (first_conv, "logits"):
        shift_before = np.abs(before[name] - reference[name]).max()
        shift_after = np.abs(after[name] - reference[name]).max()
        assert shift_before > 0 and shift_after < 0.5 * shift_before, (name, shift_before, shift_after)


def test_fp16_keeps_float32_io(small_cnn, tmp_path):
    src, _, evaluation = small_cnn
    dst = tmp_path / "model.fp16.onnx"
    image_quant.fp16(src, dst)
    model = onnx.load(str(dst))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer)
    metrics = image_quant.agreement(image_quant.run_logits(src, evaluation), image_quant.run_logits(dst, evaluation))
    assert metrics["max_abs_logit_diff"] < 1e-2 and metrics["top1_agreement"] == 1.0


def test_agreement_and_calibration_reader():
    ref = np.array([[2.0, 0.0], [0.0, 1.0]])
    m = image_quant.agreement(ref, np.array([[2.0, 0.0], [1.5, 1.0]]))
    assert m["top1_agreement"] == 0.5 and m["max_abs_logit_diff"] == 1.5 and 0.3 < m["prob_diff"] < 0.4
    assert "top1_accuracy" not in m


def test_agreement_counts_decided_images_and_true_class_accuracy():
    # image 0: decided for class 0 (p 0.88 vs 0.12); image 1: split (p 0.51 vs 0.49), then flipped;
    # image 2: decided for class 1, kept
    ref = np.array([[2.0, 0.0], [0.04, 0.0], [0.0, 3.0]])
    got = np.array([[1.5, 0.0], [0.0, 0.5], [0.0, 2.0]])
    m = image_quant.agreement(ref, got, labels=np.array([0, 1, 0]))
    assert m["top1_agreement"] == 2 / 3 and m["decided_images"] == 2 and m["decided_top1_agreement"] == 1.0
    # the reference is right on image 0; the variant on images 0 and 1
    assert m["reference_top1_accuracy"] == 1 / 3 and m["top1_accuracy"] == 2 / 3
    assert m["accuracy_drop"] == -1 / 3
    # a flip on a decided image counts
    m = image_quant.agreement(ref, np.array([[0.0, 1.0], [0.0, 0.5], [0.0, 2.0]]))
    assert m["decided_top1_agreement"] == 0.5
    # no decided image at all: no figure, and a gate on it fails
    undecided = image_quant.agreement(ref[1:2], got[1:2])
    assert "decided_top1_agreement" not in undecided and undecided["decided_images"] == 0
    assert check_gate(undecided, {"min_decided_top1_agreement": 0.98}) == ["decided_top1_agreement = None < 0.98"]
    reader = image_quant.PhotoCalibrationReader(np.zeros((5, 3, 4, 4), np.float32), batch_size=2)
    shapes = [reader.get_next()["pixel_values"].shape[0] for _ in range(3)]
    assert shapes == [2, 2, 1] and reader.get_next() is None
    reader.rewind()
    assert reader.get_next() is not None


def test_default_export_is_the_trained_efficientnet(tmp_path, monkeypatch):
    # The default export's path and record; its parity on all 192 photos is `python -m export`'s
    # gate of the served model (make test runs it first): here the first 16.
    photos = image_classifier.evaluation_pixels
    monkeypatch.setattr(image_classifier, "evaluation_pixels", lambda model=image_classifier.DEFAULT: photos(model)[:16])
    repo = tmp_path / "repo"
    result = image_classifier.export(repo)
    assert result.provenance == "pretrained" and result.top1_agreement == 1.0
    model_path, labels_path = image_classifier.paths(repo)
    assert model_path.parent.parent.name == "image_classifier" and labels_path.is_file()
    manifest = json.loads(model_path.with_suffix(".export.json").read_text())
    assert manifest["architecture"] == "efficientnet_lite0"
    assert manifest["source"]["weights"]["source"] == "packaged"
    assert "crop_then_resize" in manifest["source"]["preprocess"]
    assert image_classifier.up_to_date(repo) and image_classifier.export(repo).skipped
    # ResNet-50 is another model: not exported by this, and not up to date
    assert not image_classifier.up_to_date(repo, model=RN)
    graph = onnx.load(str(model_path), load_external_data=False)
    assert [i.name for i in graph.graph.input] == ["pixel_values"] and [o.name for o in graph.graph.output] == ["logits"]
