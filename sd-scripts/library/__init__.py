"""sd-scripts library (kohya-compatible): model loading, datasets, training core, compile support."""
import os as _os
import sys as _sys

# TORCHINDUCTOR_CACHE_DIR as the user's environment had it, read before torch's inductor is imported: importing
# torch._dynamo (diffusers, library.compile do) sets it to torch's own /tmp default, which must not pass for a
# user's choice (library.compile.environment.default_compile_cache_dir). None: torch's inductor was already imported, unknown.
INDUCTOR_CACHE_DIR_AT_START: tuple[str | None] | None = (
    None if "torch._inductor" in _sys.modules else (_os.environ.get("TORCHINDUCTOR_CACHE_DIR"),))
