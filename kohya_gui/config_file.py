"""Save and open configuration TOML files against the registry.

Format (the same for Save configuration, presets/ and the trainers' --config_file)::

    [gui]                 # which tab and family; the trainers skip this table
    tab = "lora"
    family = "SDXL"

    [model]               # trainer options, one table per accordion (the trainers flatten tables)
    pretrained_model_name_or_path = "..."
    ...
    [accelerate]          # launch-only options; the trainers skip this table
    num_processes = 2

Only options that apply to the tab and family are written, and only when they differ from their default
(family-implied ones such as v2 and network_module always). Writing is deterministic, so Save -> Open -> Save
gives the same bytes. Opening validates everything before anything is applied: one bad key and nothing changes.
"""

from __future__ import annotations

import difflib
import os
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit

from . import params as P
from .secret_options import without_secrets


MAX_BYTES = 2 * 1024 * 1024  # a settings file is a few KiB
MAX_PROBLEMS = 20  # problems listed (then a count); suggestions are worked out for these only


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file, the key and what is allowed."""


@dataclass
class Config:
    tab: str
    family: str
    values: dict[str, Any]  # every control parameter of the tab (defaults for those not in the file)


def _toml_value(p: P.Param, value: Any) -> Any:
    if p.kind == "float":
        return int(value) if p.whole_as_int and float(value).is_integer() else float(value)
    if p.kind == "list":
        return [float(v) if p.item_kind == "float" else int(v) if p.item_kind == "int" else v for v in value]
    return value


def to_toml(tab: str, family: str, values: dict[str, Any]) -> str:
    """The file text for these values: [gui], then trainer tables in accordion order, then [accelerate].
    Secrets (tokens, API keys) are never written (kohya_gui.secret_options)."""
    values = without_secrets(values)
    doc = tomlkit.document()
    gui = tomlkit.table()
    gui.add("tab", tab)
    gui.add("family", family)
    doc.add(P.GUI_TABLE, gui)
    tables: dict[str, Any] = {}
    values = P.fold_network_args(tab, family, values)
    for p in P.params_for(tab, family):
        if p.network_arg:  # folded into network_args above
            continue
        if p.fixed:
            value = p.fixed[family]
        else:
            value = p.effective(p.check(values.get(p.name, p.default_for(tab, family)), tab), family)
            if value is None or (p.is_default(value, tab) and not p.must_write(family)):
                continue
        if p.table == P.GUI_TABLE:
            gui.add(p.name, _toml_value(p, value))
            continue
        tables.setdefault(p.table, []).append((p, value))
    order = [k for k in P.ACCORDIONS if k != P.LAUNCH_TABLE] + [P.LAUNCH_TABLE]
    for key in order:
        if key not in tables:
            continue
        t = tomlkit.table()
        for p, value in tables[key]:
            t.add(p.name, _toml_value(p, value))
        doc.add(key, t)
    return tomlkit.dumps(doc)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Writes to a temporary file in the same folder, then renames it over the target."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # open(..., "x") creates the file with the user's umask (mkstemp would make it 0600: a run's TOML or a saved
    # config then could not be read by another user or a web server)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# the first line of a run's TOML (training.start): the record of what that run trained, which no Save replaces
RUN_RECORD = "# kohya_gui: the settings a training run was started with; Save configuration never replaces this file\n"


def is_run_record(path: str | os.PathLike) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline(len(RUN_RECORD) + 1) == RUN_RECORD
    except OSError:
        return False


def save(path: str | os.PathLike, tab: str, family: str, values: dict[str, Any], *, run_record: bool = False) -> Path:
    """Writes the configuration. An existing run record (a run's TOML in its output folder) is never replaced, so
    a run trains, and its folder keeps, exactly what Start wrote; `run_record=True` (Start) writes one."""
    if not run_record and is_run_record(path):
        raise ConfigError(f"{path} is the record of a training run (written by Start: what that run trained); "
                          "save your settings under another name")
    try:
        text = to_toml(tab, family, values)
    except ValueError as e:
        raise ConfigError(f"{path}: cannot save: {e}") from e
    return write_text_atomic(path, (RUN_RECORD if run_record else "") + text)


def _closest(name: str) -> str:
    match = difflib.get_close_matches(name, list(P.BY_NAME), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _flatten(source: str, data: dict) -> tuple[dict, dict, list[tuple[str, str, Any]], list[str]]:
    """Splits parsed TOML into ([gui] table, [accelerate] table, [(table, key, value)] trainer keys, errors)."""
    gui, launch, trainer, errors = {}, {}, [], []
    for key, value in data.items():
        if key == P.GUI_TABLE and isinstance(value, dict):
            gui = value
        elif key == P.LAUNCH_TABLE and isinstance(value, dict):
            launch = value
        elif isinstance(value, dict):  # a table (no option takes a table value)
            for sub, v in value.items():
                if isinstance(v, dict):
                    errors.append(f"{source}: [{key}.{sub}]: nested tables are not allowed here")
                else:
                    trainer.append((key, sub, v))
        else:
            trainer.append(("", key, value))
    return gui, launch, trainer, errors


def infer_family(keys: dict[str, Any], fallback: str) -> str:
    """Family of a plain sd-scripts TOML without a [gui] table (the importer uses the same rule)."""
    return P.guess_family(keys, fallback)


def parse(text: str, source: str, tab: str | None = None, family: str = "SDXL") -> Config:
    """Validates a configuration text. `tab`: the tab it is opened in (None = take the file's);
    `family`: used when the file does not say. Raises ConfigError listing every problem."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise ConfigError(f"{source}: not valid TOML: arrays or tables nested too deeply") from None
    except ValueError as e:  # e.g. an integer longer than Python's 4300-digit limit
        raise ConfigError(f"{source}: not valid TOML: {str(e).split(';')[0]}") from None
    gui, launch, trainer, errors = _flatten(source, data)

    gui_keys = ["tab", "family"] + [p.name for p in P.PARAMS if p.target == "gui"]
    for key in gui:
        if key not in gui_keys:
            errors.append(f"{source}: [gui] {key}: unknown key; allowed keys: {', '.join(map(repr, gui_keys))}")
    file_tab = gui.get("tab", tab or "lora")
    if file_tab not in P.TABS:
        errors.append(f"{source}: [gui] tab: {file_tab!r} is not one of the allowed values: "
                      + ", ".join(map(repr, P.TABS)))
        file_tab = tab or "lora"
    elif tab is not None and file_tab != tab:
        errors.append(f"{source}: [gui] tab: this file is for the {P.TAB_LABELS[file_tab]} tab; "
                      f"open it there (this is the {P.TAB_LABELS[tab]} tab)")
    flat = {k: v for _, k, v in trainer}
    file_family = gui.get("family", infer_family(flat, family))
    if file_family not in P.FAMILIES:
        errors.append(f"{source}: [gui] family: {file_family!r} is not one of the allowed values: "
                      + ", ".join(map(repr, P.FAMILIES)))
        file_family = family
    if (file_tab, file_family) not in P.SCRIPTS:
        errors.append(f"{source}: [gui] family: the {P.TAB_LABELS[file_tab]} tab trains "
                      f"{', '.join(P.tab_families(file_tab))}, not {file_family}")
        file_family = P.tab_families(file_tab)[-1]
    what = f"{P.TAB_LABELS[file_tab]} {file_family} ({P.script_for(file_tab, file_family)})"

    values = P.defaults(file_tab, file_family)  # a family whose script has its own defaults gets them
    seen: set[str] = set()
    entries = [(P.LAUNCH_TABLE, k, v) for k, v in launch.items()] + trainer + \
        [(P.GUI_TABLE, k, v) for k, v in gui.items() if k not in ("tab", "family") and k in gui_keys]
    for table, key, value in entries:
        where = f"{source}: {'[' + table + '] ' if table else ''}{key}"
        p = P.BY_NAME.get(key)
        if p is None:
            errors.append(f"{where}: unknown key" + (_closest(key) if len(errors) < MAX_PROBLEMS else ""))
            continue
        if key in seen:
            errors.append(f"{where}: given twice")
            continue
        seen.add(key)
        if table == P.GUI_TABLE or p.target == "gui":
            if table != p.table:
                errors.append(f"{where}: belongs in the [{p.table}] table")
                continue
        elif (table == P.LAUNCH_TABLE) != (p.target == "launch"):
            errors.append(f"{where}: belongs in the [{p.table}] table, not "
                          + (f"[{table}]" if table else "at the top level")
                          + (" (the trainer ignores [accelerate])" if table == P.LAUNCH_TABLE else ""))
            continue
        if not p.applies(file_tab, file_family):
            errors.append(f"{where}: not used by {what}")
            continue
        if p.fixed:
            if value != p.fixed[file_family]:
                errors.append(f"{where}: must be {p.fixed[file_family]!r} for {file_family}")
            continue
        try:
            values[key] = p.check(value, file_tab)
        except ValueError as e:
            errors.append(f"{where}: {e}")
    if errors:
        more = [f"... and {len(errors) - MAX_PROBLEMS} more problems"] if len(errors) > MAX_PROBLEMS else []
        raise ConfigError("\n".join(errors[:MAX_PROBLEMS] + more))
    return Config(file_tab, file_family, P.unfold_network_args(file_tab, file_family, values))


def load(path: str | os.PathLike, tab: str | None = None, family: str = "SDXL") -> Config:
    return parse(read_text(path), str(path), tab, family)


def read_text(path: str | os.PathLike) -> str:
    """A settings file's text; a missing, huge, binary or non-UTF-8 file is a ConfigError naming it."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ConfigError(f"{path}: {path.stat().st_size / 2**20:.1f} MiB is too large for a settings file "
                              f"(at most {MAX_BYTES // 2**20} MiB)")
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in data:
        raise ConfigError(f"{path}: not a UTF-8 text file (binary, or UTF-16: save it as UTF-8)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {e.start}); save it as UTF-8") from None
