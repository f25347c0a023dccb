"""Generates docs/PARITY.md: every kohya-ss/sd-scripts (upstream) option of the seven scripts and of the tool scripts
(parity.TOOLS: captioning, dataset and LoRA tools) and its status here.

    python tools/gen_parity.py            # writes docs/PARITY.md
    python tools/gen_parity.py --check    # exit 1 when docs/PARITY.md is stale or a parser differs unexplained

Inputs: upstream's option tables (`../shared/parity/upstream-flags/<script>.json`, beside the repository),
our scripts' `setup_parser()`, and the exception tables of `sd-scripts/library/parity.py` (REFUSED,
DIFFERENT, NOT_YET). tests/test_upstream_parity.py uses the same comparison.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SD_SCRIPTS = REPO / "sd-scripts"


def _shared_dir() -> Path:
    """`shared/` beside the checkout (CI: a clean clone with shared/ next to it); in a git worktree, beside
    the main checkout."""
    here = REPO.parent / "shared"
    git = REPO / ".git"
    if not here.is_dir() and git.is_file():  # a worktree: ".git" is "gitdir: <main>/.git/worktrees/<name>"
        gitdir = Path(git.read_text().split("gitdir:", 1)[1].strip())
        return gitdir.parents[2].parent / "shared"
    return here


UPSTREAM_FLAGS = _shared_dir() / "parity" / "upstream-flags"
# tables the shared folder lacks, made the same way (../shared/parity/upstream_flags_ast.py on upstream's source at
# 48d368f, e.g. `python upstream_flags_ast.py UPSTREAM anima_train.py tools/upstream-flags/anima_train.json`)
REPO_FLAGS = REPO / "tools" / "upstream-flags"
PARITY_MD = REPO / "docs" / "PARITY.md"
FIELDS = ("opts", "type", "default", "choices", "nargs", "action")

if str(SD_SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SD_SCRIPTS))

from library import parity  # noqa: E402

# statuses; the last two are errors the test reports
SAME, REFUSED, DIFFERENT, NOT_YET, MISSING, DIFFERS = ("same", "refused", "different", "not yet", "MISSING",
                                                       "DIFFERS")


@dataclass(frozen=True)
class Row:
    option: str
    status: str
    note: str = ""


def load_upstream(flags_dir: Path = UPSTREAM_FLAGS) -> dict[str, dict[str, dict]]:
    def table(script: str) -> Path:
        path = flags_dir / f"{script}.json"
        return path if path.exists() else REPO_FLAGS / f"{script}.json"

    return {s: json.loads(table(s).read_text()) for s in parity.SCRIPTS}


def load_parsers() -> dict[str, argparse.ArgumentParser]:
    return {s: importlib.import_module(s).setup_parser() for s in parity.SCRIPTS}


def describe(action: argparse.Action) -> dict:
    """One of our parser's options in the format of upstream's tables (default as repr, choices as str)."""
    t = action.type
    return {"opts": list(action.option_strings),
            "type": None if t is None else getattr(t, "__name__", repr(t)),
            "default": repr(action.default),
            "choices": None if action.choices is None else [str(c) for c in action.choices],
            "nargs": action.nargs,
            "action": type(action).__name__}


def _type_key(entry: dict) -> str | None:
    t = entry["type"]
    if entry["action"] == "_StoreAction" and t in (None, "Path"):
        # a plain store keeps the text (type None) and a pathlib.Path reads any text as well: both are "str"
        # to a user, and keeping str makes the run's TOML write the path back as text
        return "str"
    return t


def field_diffs(upstream: dict, ours: dict) -> dict[str, tuple]:
    """The fields where our option is declared differently from upstream's: {field: (upstream, ours)}."""
    out = {}
    for f in FIELDS:
        u, o = upstream[f], ours[f]
        if f == "type":
            u, o = _type_key(upstream), _type_key(ours)
        if u != o:
            out[f] = (upstream[f], ours[f])
    return out


def _fmt_diffs(diffs: dict[str, tuple]) -> str:
    return "; ".join(f"{f}: upstream {u!s}, here {o!s}" for f, (u, o) in diffs.items())


def script_rows(upstream: dict[str, dict], parser: argparse.ArgumentParser,
                different: dict | None = None) -> list[Row]:
    """The status of every upstream option of one script; `different`: a tool script's own DIFFERENT table (the
    tools have no REFUSED or NOT_YET options)."""
    tool = different is not None
    refused, not_yet = ({}, frozenset()) if tool else (parity.REFUSED, parity.NOT_YET)
    different = different if tool else parity.DIFFERENT
    ours = {a.dest: describe(a) for a in parser._actions if a.option_strings and a.dest != "help"}
    rows = []
    for name in sorted(upstream):
        if name not in ours:
            if name in not_yet:
                rows.append(Row(name, NOT_YET))
            else:
                rows.append(Row(name, MISSING, "not accepted and not in parity.NOT_YET"))
            continue
        diffs = field_diffs(upstream[name], ours[name])
        if name in refused:
            rows.append(Row(name, DIFFERS, _fmt_diffs(diffs)) if diffs else Row(name, REFUSED, refused[name]))
        elif name in different:
            spec = different[name]
            unexplained = {f: d for f, d in diffs.items() if f not in spec.fields}
            if unexplained:
                rows.append(Row(name, DIFFERS, _fmt_diffs(unexplained)))
            else:
                rows.append(Row(name, DIFFERENT, "; ".join(x for x in (spec.reason, _fmt_diffs(diffs)) if x)))
        elif name in not_yet:
            rows.append(Row(name, NOT_YET, f"parsed differently for now ({_fmt_diffs(diffs)})" if diffs else ""))
        elif diffs:
            rows.append(Row(name, DIFFERS, _fmt_diffs(diffs)))
        else:
            rows.append(Row(name, SAME))
    return rows


def all_rows(upstream_all: dict, parsers: dict) -> dict[str, list[Row]]:
    return {s: script_rows(upstream_all[s], parsers[s]) for s in parity.SCRIPTS}


def table_problems(upstream_all: dict, parsers: dict) -> list[str]:
    """Stale entries of parity's tables: a NOT_YET option at parity in every script upstream has it in, a
    DIFFERENT option whose declared fields match everywhere, names upstream does not have, names in two tables."""
    problems = []
    known = set().union(*(set(u) for u in upstream_all.values()))
    tables = {"REFUSED": set(parity.REFUSED), "DIFFERENT": set(parity.DIFFERENT), "NOT_YET": set(parity.NOT_YET)}
    for table, names in tables.items():
        for name in sorted(names - known):
            problems.append(f"parity.{table}: {name!r} is no upstream option of the seven scripts")
    for a, b in (("REFUSED", "DIFFERENT"), ("REFUSED", "NOT_YET"), ("DIFFERENT", "NOT_YET")):
        for name in sorted(tables[a] & tables[b]):
            problems.append(f"{name!r} is in both parity.{a} and parity.{b}")
    for name in sorted(parity.NOT_YET & known):
        if all(_at_parity(upstream_all[s][name], parsers[s], name) for s in parity.SCRIPTS
               if name in upstream_all[s]):
            problems.append(f"parity.NOT_YET: {name!r} has landed (parses as upstream in every script that has "
                            "it): remove it from the table")
    for name in sorted(set(parity.KOHYA_SS_GUI_KEYS) & known):
        problems.append(f"parity.KOHYA_SS_GUI_KEYS: {name!r} is an upstream option: parse it instead of skipping it")
    for name, spec in parity.DIFFERENT.items():
        if not spec.fields:
            continue
        declared_differ = any(
            set(spec.fields) & set(field_diffs(upstream_all[s][name], _ours(parsers[s], name)))
            for s in parity.SCRIPTS if name in upstream_all[s] and _ours(parsers[s], name) is not None)
        if not declared_differ:
            problems.append(f"parity.DIFFERENT: {name!r} no longer differs in {spec.fields}: update the entry")
    return problems


def _ours(parser: argparse.ArgumentParser, name: str) -> dict | None:
    for a in parser._actions:
        if a.dest == name and a.option_strings:
            return describe(a)
    return None


def _at_parity(upstream: dict, parser: argparse.ArgumentParser, name: str) -> bool:
    ours = _ours(parser, name)
    return ours is not None and not field_diffs(upstream, ours)


# ----------------------------------------------------------------------------------------------------------
# docs/PARITY.md

_STATUS_WORD = {SAME: "same", REFUSED: "refused", DIFFERENT: "different", NOT_YET: "not yet",
                MISSING: "**missing**", DIFFERS: "**differs**"}


# ----------------------------------------------------------------------------------------------------------
# tool scripts (parity.TOOLS: captioning, dataset and LoRA tools)


def load_tools(flags_dir: Path = UPSTREAM_FLAGS) -> dict[str, tuple[dict, argparse.ArgumentParser]]:
    """table -> (upstream's options, our script's parser); the scripts are loaded from their files. A tool whose
    parser upstream builds outside setup_parser() has its table in parity.UPSTREAM_TABLES_BY_HAND."""
    import importlib.util

    out = {}
    for table, path in parity.TOOLS.items():
        spec = importlib.util.spec_from_file_location(f"_parity_{table}", SD_SCRIPTS / path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        upstream = parity.UPSTREAM_TABLES_BY_HAND.get(table) or json.loads((flags_dir / f"{table}.json").read_text())
        out[table] = (upstream, module.setup_parser())
    return out


def tool_rows(tools: dict) -> dict[str, list[Row]]:
    return {t: script_rows(up, parser, parity.TOOL_DIFFERENT.get(t, {})) for t, (up, parser) in tools.items()}


def tool_problems(tools: dict) -> list[str]:
    """Unexplained differences and stale TOOL_DIFFERENT entries of the tool scripts."""
    problems = [f"{parity.TOOLS[t]}: --{r.option}: {r.status}: {r.note}" for t, rows in tool_rows(tools).items()
                for r in rows if r.status in (MISSING, DIFFERS)]
    for table in sorted(set(parity.TOOL_DIFFERENT) - set(parity.TOOLS)):
        problems.append(f"parity.TOOL_DIFFERENT: {table!r} is not in parity.TOOLS")
    for table, entries in parity.TOOL_DIFFERENT.items():
        if table not in tools:
            continue
        up, parser = tools[table]
        for name, spec in entries.items():
            if name not in up:
                problems.append(f"parity.TOOL_DIFFERENT[{table!r}]: {name!r} is no upstream option of it")
            elif spec.fields and _ours(parser, name) is not None and not (
                    set(spec.fields) & set(field_diffs(up[name], _ours(parser, name)))):
                problems.append(f"parity.TOOL_DIFFERENT[{table!r}]: {name!r} no longer differs in {spec.fields}")
    return problems


def render_tools(tools: dict) -> list[str]:
    rows = tool_rows(tools)
    out = ["", "## Tool scripts", "",
           "Upstream's captioning, dataset and LoRA tools, with the same file names under `sd-scripts/` "
           "(differences per script, from `parity.TOOL_DIFFERENT`). Every tool also takes `--dump_options` (its "
           "options as JSON, for the GUI); the LoRA tools take `--overwrite` (an existing output is replaced only "
           "with it). `convert_flux_lora.py`'s upstream options come from its source "
           "(`parity.UPSTREAM_TABLES_BY_HAND`): upstream builds that parser outside `setup_parser()`.", "",
           "| script | upstream options | same | different |", "|---|---|---|---|"]
    for t, rs in rows.items():
        out.append(f"| `{parity.TOOLS[t]}` | {len(rs)} | {sum(r.status == SAME for r in rs)} | "
                   f"{sum(r.status == DIFFERENT for r in rs)} |")
    for t, rs in rows.items():
        out += ["", f"### {parity.TOOLS[t]}", "", "| option | status | note |", "|---|---|---|"]
        out += [f"| `--{r.option}` | {_STATUS_WORD[r.status]} | {r.note.replace('|', chr(92) + '|')} |" for r in rs]
        up, parser = tools[t]
        extra = sorted(a.option_strings[0] for a in parser._actions
                       if a.option_strings and a.dest != "help" and a.dest not in up)
        if extra:
            out += ["", "Options only here: " + ", ".join(f"`{o}`" for o in extra) + "."]
    return out


def render(upstream_all: dict, parsers: dict, tools: dict | None = None) -> str:
    tools = load_tools() if tools is None else tools
    rows = all_rows(upstream_all, parsers)
    out = [
        "# Option parity with kohya-ss/sd-scripts",
        "",
        "Generated by `tools/gen_parity.py` from our scripts' parsers, the tables in `sd-scripts/library/parity.py`",
        "and upstream's option tables (kohya-ss/sd-scripts 48d368f); do not edit by hand. `tests/test_upstream_parity.py`",
        "fails when this file is stale or a parser differs from upstream without an entry in those tables.",
        "",
        "Status: **same** = accepted with upstream's option strings, type, default, choices and nargs, and implemented;",
        "**refused** = accepted with upstream's type and default, but a non-default value stops the run (exit 2) with",
        "the reason and what to use instead; **different** = differs on purpose (reason given); **not yet** = not",
        "accepted yet (a command line or config file that sets it stops with exit 2 naming it), or parsed",
        "differently for now (the note says how).",
        "",
        "| script | upstream options | same | different | refused | not yet |",
        "|---|---|---|---|---|---|",
    ]
    for s in parity.SCRIPTS:
        counts = {st: sum(r.status == st for r in rows[s]) for st in _STATUS_WORD}
        out.append(f"| `{s}.py` | {len(rows[s])} | {counts[SAME]} | {counts[DIFFERENT]} | {counts[REFUSED]} | "
                   f"{counts[NOT_YET]} |")
    out += ["", "Upstream scripts not here yet:", ""]
    out += [f"- `{s.replace('__', '/')}.py`: {why}" for s, why in parity.SCRIPTS_NOT_YET.items()]
    for s in parity.SCRIPTS:
        out += ["", f"## {s}.py", "", "| option | status | note |", "|---|---|---|"]
        for r in rows[s]:
            note = r.note.replace("|", "\\|")
            out.append(f"| `--{r.option}` | {_STATUS_WORD[r.status]} | {note} |")
        extra = sorted(a.option_strings[0] for a in parsers[s]._actions
                       if a.option_strings and a.dest != "help" and a.dest not in upstream_all[s])
        if extra:
            out += ["", "Options only here: " + ", ".join(f"`{o}`" for o in extra) + "."]
    out += ["", "## Config files (`--config_file`)", "",
            "Upstream accepts any key in a config file and ignores the ones that are no option; here an unknown key",
            "stops the run (exit 2, every bad key named in one message with the closest option), except these keys",
            "that the kohya_ss GUI writes into its run TOMLs, which are skipped with a log line:", "",
            "| key | what it is |", "|---|---|"]
    out += [f"| `{k}` | {v} |" for k, v in parity.KOHYA_SS_GUI_KEYS.items()]
    out += ["", "Values the kohya_ss GUI writes that upstream's parser would refuse on the command line (argparse "
            "checks", "no choices of config-file values), read as upstream reads them:", ""]
    out += [f"- `{k} = {v!r}` means `{k}` unset (the default)" if m is None else
            f"- `{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}` means `{k} = {m!r}` (a file from before "
            f"it had more values)"
            for k, aliases in parity.CONFIG_VALUE_ALIASES.items() for v, m in aliases.items()]
    out += ["- `0` / `1` for an on/off option (e.g. `persistent_data_loader_workers = 1`) mean false / true."]
    out += render_tools(tools)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check that docs/PARITY.md is up to date")
    ap.add_argument("--upstream_flags", type=Path, default=UPSTREAM_FLAGS)
    a = ap.parse_args(argv)
    if not a.upstream_flags.is_dir():
        print(f"upstream option tables not found: {a.upstream_flags}", file=sys.stderr)
        return 2
    upstream_all, parsers, tools = load_upstream(a.upstream_flags), load_parsers(), load_tools(a.upstream_flags)
    text = render(upstream_all, parsers, tools)
    problems = table_problems(upstream_all, parsers) + tool_problems(tools)
    for s, rs in all_rows(upstream_all, parsers).items():
        problems += [f"{s}: --{r.option}: {r.status}: {r.note}" for r in rs if r.status in (MISSING, DIFFERS)]
    for p in problems:
        print(p, file=sys.stderr)
    if a.check:
        stale = not PARITY_MD.exists() or PARITY_MD.read_text() != text
        if stale:
            print(f"{PARITY_MD} is stale: run python tools/gen_parity.py", file=sys.stderr)
        return 1 if stale or problems else 0
    PARITY_MD.write_text(text)
    print(f"wrote {PARITY_MD}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
