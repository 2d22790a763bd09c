"""The docs: a README that fits on a screen or two, links that lead somewhere, commands that
exist, and no reference to anything outside the repository."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_LIMIT_BYTES = 12 * 1024

# [text](target) and ![alt](target); a title after the target ("...") is dropped.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """Markdown without fenced blocks and code spans (links inside code are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text(encoding="utf-8")))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    # GitHub keeps underscores (`text_generation` -> text_generation); emphasis marks and backticks go.
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_readme_fits_the_limit():
    size = len(README.read_bytes())
    assert size <= README_LIMIT_BYTES, (
        f"README.md is {size:,} bytes, over the {README_LIMIT_BYTES:,}-byte limit: it is the quickstart; "
        "move detail to a page under docs/ and link it"
    )


def test_the_link_parser_finds_links():
    # Guards the tests below against a regex that silently finds nothing.
    found = LINK.findall('see [a](docs/a.md), [b](b.md#x "t") and `[c](not-a-link.md)`\n```\n[d](e.md)\n```')
    assert found == ["docs/a.md", "b.md#x", "not-a-link.md", "e.md"]
    assert LINK.findall(prose("[a](x.md) `[c](y.md)`\n```\n[d](e.md)\n```\n")) == ["x.md"]
    assert slug("Choosing what is served: `PRECISION`") == "choosing-what-is-served-precision"
    assert slug("Calling `text_generation`") == "calling-text_generation"  # as GitHub renders it
    assert len(links(README)) >= 10, "README.md should link the docs pages"
    assert unknown_targets({"serve", "rollout-*", "nope", "nope-*"}, {"serve", "rollout-start"}) == ["nope", "nope-*"]


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_in_the_repository(doc: Path):
    broken = []
    for target in links(doc):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = doc if not file_part else (doc.parent / unquote(file_part)).resolve()
        if not dest.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not dest.exists():
            broken.append(f"{target} (no such file: {dest.relative_to(ROOT)})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{doc.relative_to(ROOT)} has broken links: " + "; ".join(dict.fromkeys(broken))


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc}); cannot list tracked files")
    return [ROOT / name for name in out.decode().split("\0") if name]


# An upper-case Markdown document named anywhere (like README.md) must be one of ours; a relative
# path that climbs above the repository root points at something we do not ship.
DOC_NAME = re.compile(r"\b[A-Z][A-Z0-9_-]*\.md\b")
CLIMBING_PATH = re.compile(r"(?<![\w./])((?:\.\./)+)([\w.-]+)")


def test_no_tracked_file_refers_outside_the_repository():
    files = [path for path in tracked_files() if path.is_file()]
    ours = {path.name for path in files}
    offenders = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files
        rel = path.relative_to(ROOT)
        offenders += [f"{rel}: {name}" for name in sorted(set(DOC_NAME.findall(text)) - ours)]
        for up, name in CLIMBING_PATH.findall(text):
            if not (path.parent / up / name).resolve().is_relative_to(ROOT):
                offenders.append(f"{rel}: {up}{name}")
    assert not offenders, "files cite documents that are not part of this repository (state the fact itself): " + ", ".join(
        dict.fromkeys(offenders)
    )


def test_the_outside_reference_check_can_fail(tmp_path):
    elsewhere = "NOTES" + ".md"  # spelled in two parts so this file does not cite it
    assert DOC_NAME.findall(f"see {elsewhere} and README.md") == [elsewhere, "README.md"]
    assert CLIMBING_PATH.findall("in ../other/x.txt") == [("../", "other")]
    assert not (ROOT / "docs" / "../../other").resolve().is_relative_to(ROOT)


def test_docs_name_no_machine_paths():
    pattern = re.compile(r"(?<![\w.])/(?:work|root|home|tmp)/")
    offenders = [
        f"{doc.relative_to(ROOT)}:{n}: {line.strip()}"
        for doc in doc_files()
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, "absolute paths of a machine in the docs: " + "; ".join(offenders)


def make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set()
    for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9_.-]*(?:[ \t]+[A-Za-z0-9][A-Za-z0-9_.-]*)*)[ \t]*:(?!=)", makefile, re.M):
        targets.update(m.group(1).split())
    return targets


def code_text(text: str) -> str:
    """The fenced blocks and code spans of a Markdown text: where commands are written."""
    return "\n".join([m.group(0) for m in FENCE.finditer(text)] + CODE_SPAN.findall(FENCE.sub("", text)))


def named_make_targets(path: Path) -> set[str]:
    """`make <target>` in the code of a page; `make rollout-*` names a family of targets."""
    return set(re.findall(r"\bmake\s+([a-z][a-z0-9_-]*[a-z0-9](?:-\*)?)", code_text(path.read_text(encoding="utf-8"))))


def unknown_targets(named: set[str], targets: set[str]) -> list[str]:
    return sorted(t for t in named if not (any(x.startswith(t[:-1]) for x in targets) if t.endswith("*") else t in targets))


def test_make_targets_named_in_the_docs_exist():
    targets = make_targets()
    assert {"serve", "test"} <= targets, f"the Makefile parser found only {sorted(targets)}"
    assert {"serve", "test"} <= named_make_targets(README), "README.md must give the two commands, make serve and make test"
    missing = [
        f"{doc.relative_to(ROOT)}: make {t}" for doc in doc_files() for t in unknown_targets(named_make_targets(doc), targets)
    ]
    assert not missing, f"docs name make targets the Makefile lacks: {missing}"


OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")


def help_options(*command: str) -> set[str]:
    """The options a command's --help lists (for parsers built inside a function)."""
    out = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(OPTION.findall(out.stdout)) - {"--help"}


def launcher_options() -> set[str]:
    return help_options("-m", "server")


def parser_options(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:  # argparse offers no public walk over sub-commands
        found.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= parser_options(sub)
    return found - {"--help"}


def test_the_launcher_options_table_matches_the_code():
    page = ROOT / "docs" / "local-runtime.md"
    rows = [line for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("| `--")]
    documented = {flag for row in rows for flag in OPTION.findall(row.split("|")[1])}
    actual = launcher_options()
    assert len(actual) > 10, f"could not read the launcher's options: {actual}"
    assert not documented - actual, f"{page.name} documents options python -m server lacks: {sorted(documented - actual)}"
    assert not actual - documented, f"python -m server options missing from {page.name}'s table: {sorted(actual - documented)}"


def test_rollout_docs_name_only_real_options():
    from ops.rollout import build_parser

    page = ROOT / "docs" / "versions-and-rollout.md"
    # The page also gives the launcher's --rollout-state and the router cost script's flags.
    known = parser_options(build_parser()) | launcher_options() | help_options("scripts/router_cost.py")
    named = set(OPTION.findall(page.read_text(encoding="utf-8")))
    assert "--dwell" in named, "the link between the page and the rollout command was lost"
    assert not named - known, f"{page.name} names options no command has: {sorted(named - known)}"


# A pointer to a README section by its title, quoted after README or after "README, " in parentheses.
README_SECTION = re.compile(r"README[,:]? \"?((?:[A-Z][\w-]*)(?: [\w-]+)*)\"?[)\"]")


def test_pointers_to_readme_sections_name_sections_it_has():
    headings = {m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.*)$", README.read_text(encoding="utf-8"), re.M)}
    stale = []
    for path in tracked_files():
        if path == Path(__file__).resolve():
            continue  # its own examples
        if path.suffix not in {".py", ".md", ".yml", ".yaml", ".sh", ".pbtxt", ".toml"} and path.name != "Makefile":
            continue
        for section in README_SECTION.findall(path.read_text(encoding="utf-8", errors="replace")):
            if section not in headings:
                stale.append(f"{path.relative_to(ROOT)}: README {section!r}")
    assert not stale, f"README has no such sections (its headings: {sorted(headings)}): {stale}"


def test_the_readme_section_pointer_check_can_fail():
    assert README_SECTION.findall("see (README, Model versions and canary rollout).") == ["Model versions and canary rollout"]
    assert README_SECTION.findall('# text_embedding_cached (README "Result cache"): a') == ["Result cache"]


def test_the_documented_defaults_and_counts_are_the_codes():
    from export.variants import PRECISION_CHOICES
    from server.models import DEFAULT_MODELS

    runtime = (ROOT / "docs" / "local-runtime.md").read_text(encoding="utf-8")
    (row,) = [line for line in runtime.splitlines() if line.startswith("| `--model` ")]
    assert re.findall(r"`(\w+)`", row.split("|")[3]) == list(DEFAULT_MODELS), row
    launcher_help = subprocess.run(
        [sys.executable, "-m", "server", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    ).stdout
    assert all(re.search(rf"\b{p}\b", launcher_help) for p in PRECISION_CHOICES), "--precision's help lacks a variant"
    # "all <n> services" of docker-compose.yml, where a page counts them
    import yaml

    names = set(yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))["services"])
    services = len(names)
    words = {"ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14}
    for path in doc_files():
        for count in re.findall(r"(?i)\b(?:all|the) (\w+) services", path.read_text(encoding="utf-8")):
            if count.lower() in words or count.isdigit():
                assert words.get(count.lower(), count) in (services, str(services)), (
                    f"{path.name}: '{count} services', compose has {services}"
                )
    # docs/gpu.md's table of the services names each of them ("`triton-cpu-1`, `-2`": a suffix)
    listed = set()
    for line in (ROOT / "docs" / "gpu.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("| `"):
            previous = ""
            for name in re.findall(r"`([\w.-]+)`", line.split("|")[1]):
                name = previous.rsplit("-", 1)[0] + name if name.startswith("-") else name
                listed.add(name)
                previous = name
    assert names <= listed, f"docs/gpu.md's service table lacks {sorted(names - listed)}"
    # the promtool cases docs/monitoring.md counts
    cases = len(yaml.safe_load((ROOT / "deploy/prometheus/tests/serving_rules_test.yml").read_text(encoding="utf-8"))["tests"])
    (said,) = re.findall(r"serving_rules_test\.yml`, (\d+) cases", (ROOT / "docs" / "monitoring.md").read_text(encoding="utf-8"))
    assert int(said) == cases, f"docs/monitoring.md says {said} promtool cases, the file has {cases}"


NAMED_FILE = re.compile(
    r"\b((?:python_backends|server|clients|openai_gateway|export|ops|perf|contract|deploy|tests|scripts|docker)/"
    r"[A-Za-z0-9_./-]+\.(?:py|js|md|yml|yaml|toml|conf|template|txt|sh|pbtxt|json))\b"
)


def test_every_file_the_docs_and_comments_name_exists():
    """A page or a comment that names a moved or deleted file (``python_backends/errors.py``
    after the move to contract/) misleads whoever follows it."""
    assert NAMED_FILE.findall("see contract/errors.py and `server/cli.py`.") == ["contract/errors.py", "server/cli.py"]
    sources = [README, *(ROOT / "docs").glob("*.md"), ROOT / "Makefile", ROOT / "docker-compose.yml"]
    for folder in (
        "python_backends",
        "server",
        "clients",
        "openai_gateway",
        "export",
        "ops",
        "perf",
        "contract",
        "deploy",
        "scripts",
    ):
        sources += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".js", ".md", ".yml", ".sh", ".template")]
    sources += sorted((ROOT / "model_repository").glob("*/config.pbtxt"))
    missing = sorted(
        {
            f"{path.relative_to(ROOT)}: {name}"
            for path in sources
            if not {"__pycache__", "results"} & set(path.parts) and path.is_file()
            for name in NAMED_FILE.findall(path.read_text(encoding="utf-8", errors="replace"))
            if not (ROOT / name).exists()
        }
    )
    assert not missing, missing
