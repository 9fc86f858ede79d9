"""pytest plumbing for the benchmarks (never loaded by `pytest tests`).

- Benchmark modules are named bench_*.py so that the default test discovery (testpaths =
  ["tests"], python_files = test_*.py) never collects them; this hook collects them when the
  folder is named (`pytest benchmarks --benchmark-only`, what `make bench` runs). A file named
  on the command line is collected by pytest itself.
- `bench_report` (session fixture): benchmarks add readable tables to it; they are printed with
  tabulate at the end of the run, after pytest-benchmark's own table (stdout of tests is
  captured, the terminal summary is not).
"""
from __future__ import annotations

import pytest
from tabulate import tabulate

_REPORT_KEY = pytest.StashKey[dict]()


def pytest_collect_file(file_path, parent):
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_configure(config):
    config.stash[_REPORT_KEY] = {}


@pytest.fixture(scope="session")
def bench_report(request) -> dict:
    """title -> {"headers": [...], "rows": [[...], ...], "notes": [str, ...], "finalize": f},
    printed at the end in insertion order; benchmarks fill it (rows may be appended test by
    test); the optional finalize(section) runs just before printing (summaries over all rows)."""
    return request.config.stash[_REPORT_KEY]


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    report = config.stash.get(_REPORT_KEY, {})
    for title, section in report.items():
        if section.get("finalize"):
            section["finalize"](section)
        if not section.get("rows"):
            continue
        terminalreporter.write_sep("=", title)
        terminalreporter.write_line(tabulate(section["rows"], headers=section["headers"],
                                             disable_numparse=True))
        for note in section.get("notes", []):
            terminalreporter.write_line(note)
