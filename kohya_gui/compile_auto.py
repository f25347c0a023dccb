"""What the trainer chose for the compile settings left at `auto`, read from its log lines (the GUI never imports
the trainers): `--compile_dynamic auto` (library.compile.regional's "Compiled N blocks" line says "static shapes"
or "inputs dynamic") and `--cuda_graph_step auto` (library.compile.graphs.resolve: "on (...)" or "off; the step
graph <reason>"). The Torch Compile Settings show them after a run of that tab."""

from __future__ import annotations

import re

CUDA_GRAPH_STEP = re.compile(r"--cuda_graph_step auto: (?:on \((?P<on>.*)\)|off; (?P<off>.*))$")
COMPILED_BLOCKS = re.compile(r"Compiled \d+ blocks of ")
STATIC = "static shapes (--compile_dynamic auto"
DYNAMIC = "inputs dynamic"


def feed(choices: dict[str, str], line: str) -> bool:
    """Notes in `choices` (option -> what auto chose and why) what this log line says; True if it said something."""
    if m := CUDA_GRAPH_STEP.search(line):
        choices["cuda_graph_step"] = f"on ({m['on']})" if m["on"] is not None else f"off: {m['off']}"
        return True
    if COMPILED_BLOCKS.search(line) and (STATIC in line or DYNAMIC in line):  # one choice for every compiled model
        choices["compile_dynamic"] = (
            "static (the dataset has one bucket shape)" if STATIC in line else
            "dynamic (the image-size dimensions of the blocks' inputs, so bucket shapes share the graphs)")
        return True
    return False


def markdown(choices: dict[str, str], tab_label: str) -> str:
    """The Torch Compile Settings' line about the last run of this tab ("" when auto chose nothing there)."""
    if not choices:
        return ""
    parts = [f"`--{option} auto` → {choices[option]}" for option in ("compile_dynamic", "cuda_graph_step")
             if option in choices]
    return f"**What auto chose in the last {tab_label} run:** " + " · ".join(parts)
