"""What the trainer chose for the compile settings left at `auto`, read from its log lines (the GUI never imports
the trainers): `--compile_dynamic auto` (library.compile.regional's "Compiled N blocks" line says "static shapes",
"inputs dynamic" or "automatic dynamic shapes"), `--cuda_graph_step auto` (library.compile.graphs.resolve: "on (...)"
or "off; the step graph <reason>") and `--compile_checkpoint_keep auto` (library.compile.checkpoint.resolve_keep:
"<choice> (<why>)");
and what the compile took and the compile cache served (library.run.events.CompileReport, after step 2). The Torch
Compile Settings show them after a run of that tab."""

from __future__ import annotations

import re

CUDA_GRAPH_STEP = re.compile(r"--cuda_graph_step auto: (?:on \((?P<on>.*)\)|off; (?P<off>.*))$")
COMPILED_BLOCKS = re.compile(r"Compiled \d+ blocks of ")
STATIC = "static shapes (--compile_dynamic auto"
DYNAMIC = "inputs dynamic"
AUTOMATIC = "automatic dynamic shapes (--compile_dynamic auto"
CHECKPOINT_KEEP = re.compile(r"--compile_checkpoint_keep auto: (?P<choice>\w+) \((?P<why>.*)\)$")
COMPILE_REPORT = re.compile(r"torch\.compile after step \d+: (?P<report>.*)$")
OPTIONS = ("compile_dynamic", "cuda_graph_step", "compile_checkpoint_keep")


def feed(choices: dict[str, str], line: str) -> bool:
    """Notes in `choices` (option -> what auto chose and why) what this log line says; True if it said something."""
    if m := CUDA_GRAPH_STEP.search(line):
        choices["cuda_graph_step"] = f"on ({m['on']})" if m["on"] is not None else f"off: {m['off']}"
        return True
    if COMPILED_BLOCKS.search(line) and (STATIC in line or DYNAMIC in line or AUTOMATIC in line):  # one for every model
        choices["compile_dynamic"] = (
            "static (the dataset has one bucket shape)" if STATIC in line else
            "automatic (one bucket shape; the text length follows the captions: one more compile at a second "
            "length)" if AUTOMATIC in line else
            "dynamic (the image-size dimensions of the blocks' inputs, so bucket shapes share the graphs)")
        return True
    if m := CHECKPOINT_KEEP.search(line):
        choices["compile_checkpoint_keep"] = f"{m['choice']} ({m['why']})"
        return True
    if m := COMPILE_REPORT.search(line):
        choices["compile"] = m["report"]
        return True
    return False


def markdown(choices: dict[str, str], tab_label: str) -> str:
    """The Torch Compile Settings' line about the last run of this tab ("" when auto chose nothing there)."""
    parts = [f"`--{option} auto` → {choices[option]}" for option in OPTIONS if option in choices]
    lines = [f"**What auto chose in the last {tab_label} run:** " + " · ".join(parts)] if parts else []
    if "compile" in choices:
        lines.append(f"**Compile in the last {tab_label} run:** {choices['compile']}")
    return "\n\n".join(lines)
