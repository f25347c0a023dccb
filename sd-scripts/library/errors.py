"""The errors that stop a run with one clear line (exit 2, no traceback).

Every kind derives from `UserError`; a script's `run()` catches that one type. This module imports nothing,
so any module may raise these without importing the modules above it. The kinds also keep their older bases
(ValueError, RuntimeError, FileExistsError) so code that caught those still does.
"""


class UserError(Exception):
    """Bad settings or inputs, a missing package, a disk that refuses a save: the message says what to change."""

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A bad `--config_file` or a bad combination of options; the message names the key/flag."""


class OptionalPackageError(UserError, RuntimeError):
    """An option needs a package that is not installed; the message says which and how to install it."""


class OutputExistsError(UserError, FileExistsError):
    """A result file already exists and `--overwrite_output` was not given."""


class TrainingError(UserError, RuntimeError):
    """Something that stops a run with a clear message (not a bug)."""


class SaveError(UserError, RuntimeError):
    """A save the disk refused (full, read-only, no permission): the run stops with this one line."""


class DatasetError(UserError, ValueError):
    """Bad dataset input: the message names the file, folder or key and what is allowed."""


class ModelLoadError(UserError, ValueError):
    """A model path, file or option that cannot be loaded; the message names the file and what to do."""


class FluxModelError(ModelLoadError):
    """A FLUX model file or folder that cannot be used (message names the file and the problem)."""


class CompileConfigError(UserError, ValueError):
    """An impossible or unsupported combination of compile settings."""


class PromptFileError(UserError, ValueError):
    """A bad prompt file: the message names the file, the line (or entry) and what is allowed."""


class NetworkArgsError(UserError, ValueError):
    """A bad `--network_args` entry; the message names it and lists the allowed keys."""


class NetworkWeightsError(NetworkArgsError):
    """`--network_weights` that cannot be loaded into the network (a shape that differs)."""


class BlockArgsError(UserError, ValueError):
    """A bad block value in --network_args (networks.lora turns it into NetworkArgsError)."""


class BlockSwapError(UserError, ValueError):
    """Bad --blocks_to_swap for this model."""
