"""The base model's hashes upstream writes into a LoRA's metadata (ss_sd_model_hash / ss_new_sd_model_hash): the
first 8 hex digits of sha256 over 64 KiB at offset 1 MiB (A1111's old hash) and sha256 of the whole file.

Standard library only, so that library.metadata can run it as a script in a child process
(`python -I -S file_hash.py FILE` prints "legacy full"): a 7-23 GB checkpoint takes 5-20 s, and a thread in the
trainer taking the GIL back after every read slowed the compiled first steps it overlapped.
"""
import hashlib
import os
import signal
import sys


def hash_file(path: str) -> tuple[str, str]:
    with open(path, "rb") as f:
        f.seek(0x100000)
        legacy = hashlib.sha256(f.read(0x10000)).hexdigest()[:8]
        f.seek(0)
        full = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            full.update(chunk)
    return legacy, full.hexdigest()


if __name__ == "__main__":
    if hasattr(os, "nice"):
        os.nice(10)  # behind the trainer's own work
    # the GUI's Stop (SIGTERM to every process of the run) and a terminal's Ctrl+C are the trainer's stop-and-save,
    # whose save needs this answer: the trainer ends this process itself when it exits
    for name in ("SIGTERM", "SIGINT", "SIGBREAK"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    print(*hash_file(sys.argv[1]))
