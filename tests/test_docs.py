"""The docs stay readable and true: no page over 300 lines, the README's quick start short, every
measured speed in docs/figures.md (written by scripts/figures.py from the benchmarks' JSON lines),
and every link to a file of the repository pointing at one."""

import importlib.util
import json
import re

from conftest import REPO

PAGES = sorted((REPO / "docs").rglob("*.md"))
# A throughput, a FLOP rate, an MFU or a speed ratio (1.5x): figures only a benchmark produces.
MEASURED = re.compile(
    r"\d[\d,.]*\s*(?:tokens/s|tok/s|tokens per second|images/s|requests/s|req/s|steps/s|[GTM]FLOP/s)"
    r"|\d+(?:\.\d+)?\s*%\s*(?:MFU|of\s+(?:the\s+|its\s+)?(?:measured\s+)?(?:fp32\s+|bf16\s+)?(?:matmul\s+)?peak)"
    r"|\bMFU\s+(?:of\s+)?\d+(?:\.\d+)?\s*%"
    r"|\b\d+\.\d+\s*[x×](?!\w)"
)
MEASURED_COLUMN = re.compile(r"tokens/s|tok/s|images/s|FLOP/s|\bMFU\b|step time|\bms\b")


def _figures_module():
    spec = importlib.util.spec_from_file_location("figures", REPO / "scripts" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_page_is_longer_than_300_lines():
    long = {str(p.relative_to(REPO)): n for p in PAGES if (n := len(p.read_text().splitlines())) > 300}
    assert not long, long


def test_the_quick_start_reaches_its_first_command_within_15_lines():
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index("## Quick start")
    first_command = next(i for i in range(start, len(lines)) if lines[i].startswith("    "))
    assert first_command - start - 1 <= 15, lines[start:first_command]
    commands = [line.strip() for line in lines[start:] if line.startswith("    pip install")]
    assert commands[:2] == [
        "pip install -e . && python run_training.py",
        "pip install -e '.[test,reference]' && python -m pytest",
    ]


def test_figures_md_is_the_rendering_of_the_recorded_benchmarks():
    figures = _figures_module()
    records = json.loads(figures.RECORDS.read_text())
    assert records and set(records) <= {*figures.BENCHMARKS, *(f"{n} (gpu)" for n in figures.BENCHMARKS)}
    assert figures.PAGE.read_text() == figures.render(records), "run: python scripts/figures.py write"


def test_measured_speeds_appear_only_in_figures_md():
    """A doc that states a throughput, an MFU or a speed ratio, or has a table column of them,
    links to figures.md instead; the docs cannot drift from the measurements."""
    found = []
    for page in [*PAGES, REPO / "README.md", REPO / "CONTRIBUTING.md"]:
        if page.name == "figures.md":
            continue
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            found += [f"{page.name}:{number}: {m.group(0)}" for m in MEASURED.finditer(line)]
            is_header = line.startswith("|") and number < len(lines) and lines[number].startswith("|---")
            if is_header and MEASURED_COLUMN.search(line):
                found.append(f"{page.name}:{number}: a table of measured figures")
    assert not found, found


def test_the_detector_finds_figures():
    for text in ("4,760 tokens/s", "50.8% of the measured fp32 matmul peak", "**2.20x**", "MFU of 28.3%"):
        assert MEASURED.search(text), text
    for text in ("fsdp 2 x tp 2", "2x the rows", "gemma3_1b", "32 MiB", "every 10 steps"):
        assert not MEASURED.search(text), text


def test_links_to_the_repository_point_at_files():
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    broken = []
    for page in [*PAGES, REPO / "README.md", REPO / "CONTRIBUTING.md"]:
        for target in link.findall(page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken
