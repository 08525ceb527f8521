"""The repository's pages stay true: links resolve, named paths and commands exist, every
Makefile target is named in the README, every config field is on the configuration page
and every metric on the metrics page. What users read names no project-internal work item,
the benchmarks page stays a reference, and every dated run in ``bench/runs/`` is readable.

Pure file reading (no vllm, no torch). The checkers return what is wrong, so each test shows
every broken link or missing name at once; the ``*_catch_*`` tests run them on pages written
to be wrong, so a checker that never fails fails here.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def _prose(text: str) -> str:
    """``text`` without fenced blocks and inline code (links there are examples, not links)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup and punctuation dropped,
    lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in _HEADING.findall(_FENCE.sub("", page.read_text()))}


def links(page: Path) -> list[str]:
    prose = _prose(page.read_text())
    return _LINK.findall(prose) + _REF_DEF.findall(prose)


def broken_links(pages: list[Path]) -> list[str]:
    """``page: target (why)`` for every relative link that does not resolve: a missing file or
    directory, or a ``#fragment`` that is no heading of the Markdown page it points at."""
    bad = []
    for page in pages:
        for target in links(page):
            if _EXTERNAL.match(target):
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                bad.append(f"{page.name}: {target} (no heading #{fragment} in {dest.name})")
    return bad


_TOP = ("tests", "tools", "bench", "docs", "docker", "configs", "examples", "vllm_kvtier", "requirements",
        "testkit", ".ci")
_TOP_ALT = "|".join(map(re.escape, _TOP))
_REPO_PATH = re.compile(rf"(?<![\w./-])((?:\.\./)?(?:{_TOP_ALT})/[\w./-]*[\w/])")
#: ``kvtier COMMAND`` in code; "kvtier config field ..." is an error message, not a command.
_KVTIER_CMD = re.compile(r"(?<![\w-])kvtier ([a-z][a-z-]*[a-z])(?![\w-])(?! field)")
_MAKE_CMD = re.compile(r"(?<![\w-])make ([a-z][\w-]*)")


def _code(text: str) -> str:
    """Fenced blocks and inline code of ``text``: where commands are written."""
    return "\n".join(m.group(0) for m in (*_FENCE.finditer(text), *_INLINE_CODE.finditer(text)))


def missing_names(pages: list[Path], root: Path) -> list[str]:
    """``page: name (why)`` for every repository path a page names that does not exist (outputs
    in ignored folders, such as bench/results/, aside), every ``kvtier COMMAND`` in code that
    the CLI lacks and every ``make TARGET`` in code that the Makefile lacks."""
    ignored = [line.strip().rstrip("/") for line in (root / ".gitignore").read_text().splitlines()
               if line.strip().endswith("/") and "/" in line.strip()[:-1]]
    commands = set(re.findall(r'subcommand\(sub, "([a-z-]+)"', "".join(
        p.read_text() for p in sorted((root / "vllm_kvtier" / "cli").glob("*.py")))))
    targets = set(make_targets(root / "Makefile"))
    bad = []
    for page in pages:
        text = page.read_text()
        for name in dict.fromkeys(_REPO_PATH.findall(text)):
            path = (page.parent / name) if name.startswith("../") else (root / name)
            rel = path.resolve().relative_to(root.resolve()).as_posix() if path.resolve().is_relative_to(
                root.resolve()) else name
            if not path.exists() and not any(rel == d or rel.startswith(d + "/") for d in ignored):
                bad.append(f"{page.name}: {name} (no such file)")
        code = _code(text)
        bad += [f"{page.name}: kvtier {c} (no such command)" for c in _KVTIER_CMD.findall(code) if c not in commands]
        bad += [f"{page.name}: make {t} (no such target)" for t in _MAKE_CMD.findall(code) if t not in targets]
    return bad


def make_targets(makefile: Path) -> list[str]:
    names = re.findall(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)\s*:(?!=)", makefile.read_text(), re.M)
    return [n for n in dict.fromkeys(names) if not n.startswith(".")]


def unnamed_targets(makefile: Path, readme: Path) -> list[str]:
    """Targets for which ``make <target>`` appears nowhere in ``readme``."""
    text = readme.read_text()
    return [t for t in make_targets(makefile) if not re.search(rf"\bmake {re.escape(t)}(?![\w-])", text)]


def config_fields() -> list[str]:
    """Every dotted field of ``kv_connector_extra_config``, read from the config dataclasses.
    A tier section's ``store`` is flat in YAML, so its fields sit directly under the section."""
    from vllm_kvtier.config import KVTierConfig

    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
            nested = [a for a in args if isinstance(a, type) and dataclasses.is_dataclass(a)]
            if nested:
                walk(nested[0], prefix if f.name == "store" else f"{prefix}{f.name}.")
            else:
                out.append(prefix + f.name)

    walk(KVTierConfig, "")
    return out


def metric_names() -> list[str]:
    from vllm_kvtier import metrics

    return ([f"vllm:kvtier_{m}_total" for m in metrics.CounterName]
            + [f"vllm:kvtier_{m}" for m in (*metrics.GaugeName, *metrics.HistogramName)])


def missing_code_names(names: list[str], page: Path) -> list[str]:
    """Names that do not appear as inline code on ``page`` (``vllm:kvtier_x`` also counts
    when written ``/ _x`` after another metric, as the metrics table pairs them)."""
    spans = set(_INLINE_CODE.findall(page.read_text()))
    inline = {s.strip("`") for s in spans}
    return [n for n in names if n not in inline and "_" + n.split("_", 1)[-1] not in inline]


#: words about how the project is run, not about the plugin: no user can look them up
_INTERNAL = re.compile(r"\bthe brief\b|\bbrief's|\bissues? #?\d+|\bthe issue's\b|\breview \d|\bclosing notes?\b",
                       re.I)
#: what a user reads besides the pages: preset configs, Helm values, dashboards, alert rules,
#: and the package (its messages, its docstrings)
USER_TEXT = [*PAGES, *sorted((ROOT / "configs").glob("*.yaml")),
             *sorted(p for p in (ROOT / "docker").rglob("*") if p.suffix in (".yaml", ".yml", ".json", ".txt", ".tpl")),
             *sorted((ROOT / "vllm_kvtier").rglob("*.py"))]


def internal_words(files: list[Path], root: Path) -> list[str]:
    """``file:line: words`` for every project-internal phrase in ``files`` ("the brief",
    "issue 32", "review 3", ...). Other projects' references (``vllm#49250``) pass."""
    bad = []
    for f in files:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            bad += [f"{f.relative_to(root).as_posix()}:{n}: {m.group(0)}" for m in _INTERNAL.finditer(line)]
    return bad


#: what every ``bench/runs/*.json`` holds (``bench/runs/README.md``)
RUN_KEYS = {"name", "benchmark", "date", "time_utc", "commit", "command", "machine", "source", "tables", "notes"}


def bad_runs(files: list[Path]) -> list[str]:
    """``file: why`` for every run file that is not JSON, lacks a key, is named for another
    date or name, or has a table row whose keys are not its table's columns."""
    bad = []
    for f in files:
        try:
            run = json.loads(f.read_text())
        except ValueError as e:
            bad.append(f"{f.name}: not JSON ({e})")
            continue
        if not isinstance(run, dict) or RUN_KEYS - run.keys():
            bad.append(f"{f.name}: missing {sorted(RUN_KEYS - set(run)) if isinstance(run, dict) else 'everything'}")
            continue
        if f.name != f"{run['date']}-{run['name']}.json" or not re.fullmatch(r"\d{4}-\d\d-\d\d", run["date"]):
            bad.append(f"{f.name}: named for {run['date']}-{run['name']}.json")
        if not (isinstance(run["notes"], list) and all(isinstance(n, str) for n in run["notes"])):
            bad.append(f"{f.name}: notes are not a list of strings")
        for t in run["tables"]:
            if any(list(row) != t["columns"] for row in t["rows"]) or not t["rows"]:
                bad.append(f"{f.name}: table {t['title'][:40]!r} has rows that are not its columns")
    return bad


# ---- the repository's pages ---------------------------------------------------------------


def test_pages_exist():
    names = {p.name for p in PAGES}
    for page in ("configuration", "tiers", "pd", "metrics", "deploying", "benchmarks", "planning",
                 "architecture"):
        assert f"{page}.md" in names, page


def test_every_relative_link_resolves():
    assert broken_links(PAGES) == []


def test_every_path_and_command_named_in_the_pages_exists():
    assert {"plan", "doctor"} <= set(re.findall(r'subcommand\(sub, "([a-z-]+)"', "".join(
        p.read_text() for p in (ROOT / "vllm_kvtier/cli").glob("*.py"))))
    assert missing_names(PAGES, ROOT) == []


def test_name_checker_catches_a_missing_path_command_and_target(tmp_path):
    for top in ("docs", "vllm_kvtier/cli", "bench/results"):
        (tmp_path / top).mkdir(parents=True)
    (tmp_path / ".gitignore").write_text("bench/results/\n")
    (tmp_path / "Makefile").write_text("demo:\n\ttrue\n")
    (tmp_path / "vllm_kvtier" / "cli" / "plan.py").write_text('subcommand(sub, "plan", ...)\n')
    (tmp_path / "docs" / "real.md").write_text("x")
    page = tmp_path / "README.md"
    page.write_text("See docs/real.md, docs/gone.md and bench/results/out.json.\n"
                    "```\nkvtier plan --x\nkvtier fly\nmake demo\nmake fly\n```\n")
    assert missing_names([page], tmp_path) == [
        "README.md: docs/gone.md (no such file)",
        "README.md: kvtier fly (no such command)",
        "README.md: make fly (no such target)",
    ]


def test_every_makefile_target_is_named_in_the_readme():
    targets = make_targets(ROOT / "Makefile")
    assert {"demo", "test", "bench"} <= set(targets)  # the parser reads the real Makefile
    assert unnamed_targets(ROOT / "Makefile", ROOT / "README.md") == []


def test_readme_gives_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "\nmake demo\n" in text and "\ntests/run.sh\n" in text
    assert "tests/run.sh" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


def test_every_config_field_is_on_the_configuration_page():
    fields = config_fields()
    assert "cpu.capacity_bytes" in fields and "s3.bucket" in fields and "nixl.hold_s" in fields
    assert missing_code_names(fields, ROOT / "docs" / "configuration.md") == []


def test_every_metric_is_on_the_metrics_page():
    assert missing_code_names(metric_names(), ROOT / "docs" / "metrics.md") == []


def test_user_facing_text_names_no_internal_work_item():
    assert len(USER_TEXT) > len(PAGES) + 10  # configs and docker/ are read too
    assert internal_words(USER_TEXT, ROOT) == []


def test_benchmarks_page_is_a_reference_and_every_run_file_reads():
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) <= 300
    runs = sorted((ROOT / "bench" / "runs").glob("*.json"))
    assert len(runs) >= 10
    assert bad_runs(runs) == []


def test_architecture_keeps_the_walk_placeholder_or_a_walk():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "## One block's walk" in text and "## Dependency rules" in text


# ---- the checkers catch what they are for -----------------------------------------------


def test_link_checker_catches_missing_files_and_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    other = tmp_path / "docs" / "other.md"
    other.write_text("# Other page\n\n## A `code` heading: with punctuation\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/other.md) [ok anchor](docs/other.md#a-code-heading-with-punctuation) [self](#title)\n"
        "[gone](docs/missing.md) [bad anchor](docs/other.md#nope) ![img](pic.png)\n"
        "[web](https://example.com/x) `[in code](nowhere.md)`\n\n"
        "```\n[in a fence](nowhere.md)\n```\n\n[ref]: docs/absent.md\n\n# Title\n")
    assert broken_links([page, other]) == [
        "README.md: docs/missing.md (no such file)",
        "README.md: docs/other.md#nope (no heading #nope in other.md)",
        "README.md: pic.png (no such file)",
        "README.md: docs/absent.md (no such file)",
    ]


def test_target_checker_catches_an_unnamed_target(tmp_path):
    mk = tmp_path / "Makefile"
    mk.write_text(".PHONY: a b-c\nVAR := 1\na:\n\t@true\nb-c: a\n\t@true\nb:\n\t@true\n")
    readme = tmp_path / "README.md"
    readme.write_text("Run `make a` and `make b-c`.\n")
    assert make_targets(mk) == ["a", "b-c", "b"]
    assert unnamed_targets(mk, readme) == ["b"]  # "make b-c" does not name "b"


def test_name_checker_catches_a_missing_name(tmp_path):
    page = tmp_path / "c.md"
    page.write_text("| `cpu.capacity_bytes` | ... |\n| `vllm:kvtier_a_total` / `_b_total` |\n")
    assert missing_code_names(["cpu.capacity_bytes", "cpu.eviction"], page) == ["cpu.eviction"]
    assert missing_code_names(["vllm:kvtier_a_total", "vllm:kvtier_b_total", "vllm:kvtier_c"], page) == [
        "vllm:kvtier_c"]


def test_internal_word_checker_catches_internal_phrases(tmp_path):
    page = tmp_path / "values.yaml"
    page.write_text("# The brief's rule is 0.5-0.7 (issue 32, see Issues #6).\n"
                    "# As review 3 said; the issue's run; closing notes.\n"
                    "# vllm#49250 and ai-dynamo/dynamo#12456 are fine; it issues the saves briefly.\n")
    assert internal_words([page], tmp_path) == [
        "values.yaml:1: The brief", "values.yaml:1: issue 32", "values.yaml:1: Issues #6",
        "values.yaml:2: review 3", "values.yaml:2: the issue's", "values.yaml:2: closing notes",
    ]


def test_run_checker_catches_bad_run_files(tmp_path):
    good = {"name": "x", "benchmark": "bench/serving.py", "date": "2026-12-06", "time_utc": None,
            "commit": "abc1234", "command": "bench/serving.py", "machine": "m", "source": "s",
            "tables": [{"title": "t", "columns": ["a", "b"], "rows": [{"a": "1", "b": "2"}]}], "notes": ["n"]}
    files = {
        "2026-12-06-x.json": good,
        "2026-12-07-x.json": good,
        "2026-12-06-y.json": {**good, "name": "y", "machine": None} | {"notes": "one string"},
        "2026-12-06-z.json": {**good, "name": "z", "tables": [{"title": "t", "columns": ["a", "b"],
                                                               "rows": [{"a": "1"}]}]},
        "2026-12-06-w.json": {k: v for k, v in good.items() if k != "commit"},
    }
    for name, run in files.items():
        (tmp_path / name).write_text(json.dumps(run))
    (tmp_path / "2026-12-06-v.json").write_text("{not json")
    assert [b.split(" (")[0] for b in bad_runs(sorted(tmp_path.glob("*.json")))] == [
        "2026-12-06-v.json: not JSON",
        "2026-12-06-w.json: missing ['commit']",
        "2026-12-06-y.json: notes are not a list of strings",
        "2026-12-06-z.json: table 't' has rows that are not its columns",
        "2026-12-07-x.json: named for 2026-12-06-x.json",
    ]
