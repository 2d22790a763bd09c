"""pyproject.toml says what the tree is: every top-level package but perf/ installed, every package
type-checked, the dependencies read from the requirements files `make venv` installs, every
console script runs. Nothing is built: pyproject.toml is read as setuptools reads it."""

from __future__ import annotations

import fnmatch
import importlib
import re
from pathlib import Path

import tomllib
from setuptools.config.pyprojecttoml import read_configuration

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Run from a source checkout only: benchmarks and drills with their results and peers.
NOT_SHIPPED = {"perf"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9_,-]+\])?==(\S+)$")


def _top_level_packages() -> list[str]:
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")
    assert packages, "no package found beside pyproject.toml"
    return packages


def _pin(requirement: str) -> tuple[str, str]:
    """(project name normalized as PEP 503 says, version) of an exact pin."""
    match = PIN.match(requirement.strip())
    assert match, f"{requirement!r} is not an exact pin (name==version)"
    return re.sub(r"[-_.]+", "-", match.group(1)).lower(), match.group(3)


def _pins(path: Path) -> dict[str, str]:
    """name -> version of a requirements file's lines (comments and pip options skipped)."""
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            name, version = _pin(line)
            assert name not in pins, f"{path.name} pins {name} twice"
            pins[name] = version
    return pins


def test_every_top_level_package_but_perf_is_installed():
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = {p for p in _top_level_packages() if any(fnmatch.fnmatch(p, pattern) for pattern in include)}
    assert NOT_SHIPPED <= set(_top_level_packages())
    assert shipped == set(_top_level_packages()) - NOT_SHIPPED, f"pyproject.toml's packages: {sorted(shipped)}"


def test_no_installed_package_imports_perf():
    importing = re.compile(r"^\s*(from|import) perf\b", re.M)
    found = [
        str(path.relative_to(ROOT))
        for package in set(_top_level_packages()) - NOT_SHIPPED
        for path in (ROOT / package).rglob("*.py")
        if importing.search(path.read_text(encoding="utf-8"))
    ]
    assert not found, f"installed modules import perf/, which the wheel leaves out: {found}"


def test_mypy_checks_every_top_level_package():
    files = PYPROJECT["tool"]["mypy"]["files"]
    missing = [p for p in _top_level_packages() if p not in files]
    assert not missing, f"[tool.mypy] files omit {missing}"
    absent = [f for f in files if not (ROOT / f).exists()]
    assert not absent, f"[tool.mypy] files name {absent}, which do not exist"


def test_dependencies_are_the_requirements_files_make_venv_installs():
    dynamic = PYPROJECT["tool"]["setuptools"]["dynamic"]
    groups = {"": dynamic["dependencies"]["file"]} | {g: d["file"] for g, d in dynamic["optional-dependencies"].items()}
    assert set(groups) == {"", "perf", "dev"}
    files = [f for group_files in groups.values() for f in group_files]
    # scripts/setup.sh installs exactly these, with constraints.txt (the GPU set is a swap of its own)
    (install,) = re.findall(
        r'"\$\{PIP\[@\]\}" install ((?:-r \S+ )+)-c constraints\.txt', (ROOT / "scripts/setup.sh").read_text()
    )
    assert install.split()[1::2] == files, f"setup.sh installs {install.split()[1::2]}, pyproject.toml reads {files}"
    # As setuptools expands them: the names of each group are its file's, and no package is in two.
    project = read_configuration(ROOT / "pyproject.toml")["project"]
    expanded = {"": project["dependencies"], **project["optional_dependencies"]}
    seen: dict[str, str] = {}
    for group, group_files in groups.items():
        pins = {name: version for f in group_files for name, version in _pins(ROOT / f).items()}
        assert sorted(_pin(r)[0] for r in expanded[group]) == sorted(pins), f"group {group or 'dependencies'!r}"
        for name in pins:
            assert name not in seen, f"{name} is in both {seen[name] or 'dependencies'!r} and {group or 'dependencies'!r}"
            seen[name] = group
    # constraints.txt, the whole environment's lock, pins each of them alike where it pins it
    constraints = _pins(ROOT / "constraints.txt")
    disagree = {
        name: (version, constraints[name])
        for f in files
        for name, version in _pins(ROOT / f).items()
        if name in constraints and constraints[name] != version
    }
    assert not disagree, f"requirements and constraints.txt disagree (requirement, constraint): {disagree}"
    # the GPU set replaces packages of the CPU set (onnxruntime's folder), it is no group of its own
    assert "onnxruntime-gpu" in _pins(ROOT / "requirements-gpu.txt") and "onnxruntime-gpu" not in seen


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
