"""The launcher lays out NVIDIA's tritonserver from the nvidia-pytriton wheel."""

import sys

from server.layout import prepare
from server.process import ServerOptions, TritonServer


def test_layout_has_binary_stub_and_project_backend(tmp_path):
    layout = prepare(tmp_path)
    assert layout.binary.is_file()
    assert (layout.backends / "python" / "libtriton_python.so").is_file()
    assert (layout.backends / "python" / "triton_python_backend_stub").is_file()
    assert (layout.backends / "onnxruntime" / "model.py").is_file()
    assert (layout.caches / "local").is_dir()
    # second call reuses the layout
    stamp = (layout.root / ".layout.json").stat().st_mtime_ns
    prepare(tmp_path)
    assert (layout.root / ".layout.json").stat().st_mtime_ns == stamp


def test_command_and_environment(tmp_path):
    options = ServerOptions.with_free_ports(workdir=tmp_path, cache_size_bytes=1024, front_door=False)
    server = TritonServer(options)
    server.layout = prepare(tmp_path)
    cmd = server.command()
    assert "--model-control-mode=explicit" in cmd
    assert f"--http-port={options.http_port}" in cmd and "--http-address=127.0.0.1" in cmd
    assert "--cache-config=local,size=1024" in cmd
    assert "--load-model=text_embedding" in cmd
    assert len({options.http_port, options.grpc_port, options.metrics_port}) == 3
    env = server.environment()
    assert env["PATH"].split(":")[0] == str(__import__("pathlib").Path(sys.executable).parent)
    assert str(server.layout.libs) in env["LD_LIBRARY_PATH"]
