"""The launcher lays out NVIDIA's tritonserver from the nvidia-pytriton wheel."""

import os
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
    options = ServerOptions.with_free_ports(workdir=tmp_path, cache_size_bytes=1024)
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


def test_regions_of_launchers_that_are_gone_are_released(tmp_path, monkeypatch):
    import subprocess

    from server import process

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    monkeypatch.setattr(process, "SHM_DIR", tmp_path)
    names = [
        f"triton_p{dead}_0a1b2c3d_python_1",  # a killed launcher's
        f"triton_p{os.getpid()}_0a1b2c3d_python_2",  # a live launcher's
        "triton_python_backend_shm_region_3",  # tritonserver's default name: not the project's
        "other",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert process.release_orphaned_shared_memory() == [names[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


def test_an_installed_tritonserver_is_run_in_place_with_its_backends_linked(tmp_path):
    """NVIDIA's container: its binary, lib/ and caches/ as they are; a backends folder of links under
    the work folder, the project's Python-based backends beside them unless the install has one natively."""
    import pytest

    from server.layout import check_home

    home = tmp_path / "opt-tritonserver"
    for folder in ("bin", "lib", "caches/local", "backends/python", "backends/openvino", "backends/tensorrt"):
        (home / folder).mkdir(parents=True)
    (home / "bin" / "tritonserver").write_text("")
    (home / "backends" / "openvino" / "libtriton_openvino.so").write_text("")
    work = tmp_path / "work"
    layout = prepare(work, check_home(home))
    assert layout.binary == home / "bin" / "tritonserver" and layout.libs == home / "lib" and layout.caches == home / "caches"
    assert layout.backends == work / "tritonserver-installed" / "backends"
    for name in ("python", "openvino", "tensorrt"):
        assert (layout.backends / name).is_symlink() and (layout.backends / name).resolve() == home / "backends" / name
    assert (layout.backends / "onnxruntime" / "model.py").is_file()  # the project's: the install has none
    assert not (home / "backends" / "openvino" / "model.py").exists()  # its native one wins, untouched
    # a later start where the install now has onnxruntime natively and no tensorrt: laid out again
    (home / "backends" / "onnxruntime").mkdir()
    (home / "backends" / "onnxruntime" / "libtriton_onnxruntime.so").write_text("")
    (home / "backends" / "tensorrt").rmdir()
    layout = prepare(work, home)
    assert (layout.backends / "onnxruntime").resolve() == home / "backends" / "onnxruntime"
    assert not (layout.backends / "tensorrt").exists() and not (layout.backends / "tensorrt").is_symlink()
    # where it enters: a folder without the binary is refused, naming the option and what is missing
    with pytest.raises(ValueError, match=r"--tritonserver-home .*no bin/tritonserver"):
        check_home(tmp_path / "work")
