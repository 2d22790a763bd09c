"""pyproject.toml says what the tree is: every top-level package installed and type-checked, every
console script runs."""

from __future__ import annotations

import importlib
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_top_level_package_is_installed():
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")
    assert packages, "no package found beside pyproject.toml"
    missing = [p for p in packages if f"{p}*" not in include]
    assert not missing, f"pyproject.toml's packages omit {missing}"


def _top_level_packages() -> list[str]:
    return sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")


def test_mypy_checks_every_top_level_package():
    files = PYPROJECT["tool"]["mypy"]["files"]
    missing = [p for p in _top_level_packages() if p not in files]
    assert not missing, f"[tool.mypy] files omit {missing}"
    absent = [f for f in files if not (ROOT / f).exists()]
    assert not absent, f"[tool.mypy] files name {absent}, which do not exist"


def test_console_scripts_name_callables_that_print_their_usage(capsys, monkeypatch):
    scripts = PYPROJECT["project"]["scripts"]
    assert {"embed", "generate", "chat"} <= set(scripts)
    for name, target in scripts.items():
        module, func = target.split(":")
        command = getattr(importlib.import_module(module), func)
        monkeypatch.setattr("sys.argv", [name, "--help"])
        try:
            status = command()
        except SystemExit as exc:  # argparse's --help
            status = exc.code
        assert status == 0, f"{name} --help exited {status}"
        out = capsys.readouterr().out
        assert "usage" in out.lower(), f"{name} --help printed no usage"
