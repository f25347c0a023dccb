"""Shared test setup: sd-scripts on sys.path, offline hub, one inductor cache for the session."""
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SD_SCRIPTS = REPO / "sd-scripts"
if str(SD_SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SD_SCRIPTS))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".venv" / "inductor-cache"))
# the GUI's user files (last settings, the run queue) never go to the real ~/.config during tests
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="kohya-tests-config-")


# ---- tiny SD1/SDXL models and a captioned image set, built once per session (library.tiny_models) ----
# Each model dir holds the checkpoint, the diffusers folder (same seed = same weights) and
# tokenizers/{tokenizer,tokenizer_2}: pass `path.parent / "tokenizers"` as --tokenizer_cache_dir.
import pytest  # noqa: E402


@pytest.fixture
def one_thread():
    """torch on one thread for the test: the CI box has 2 cores shared by many processes, and one thread is
    much faster there than two (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fresh_accelerate():
    """accelerate keeps the first AcceleratorState of a process (its mixed precision) and refuses another: a test
    that runs trainers in this process starts and ends without one (the returned function resets it between runs)."""
    from accelerate.state import AcceleratorState, GradientState

    def reset():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    reset()
    yield reset
    reset()


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


def _tiny(root, family, layout):
    from library.tiny_models import make_tiny_sd

    return make_tiny_sd(root / family, family, layout)


@pytest.fixture(scope="session")
def tiny_sdxl_single_file(tiny_models_dir):
    """Path of a tiny SDXL .safetensors in SGM layout; tokenizers at path.parent / 'tokenizers'."""
    return _tiny(tiny_models_dir, "sdxl", "single_file")


@pytest.fixture(scope="session")
def tiny_sdxl_diffusers(tiny_models_dir):
    """Tiny SDXL diffusers folder (tokenizers inside; same weights as tiny_sdxl_single_file)."""
    return _tiny(tiny_models_dir, "sdxl", "diffusers")


@pytest.fixture(scope="session")
def tiny_sd1_single_file(tiny_models_dir):
    """Path of a tiny SD1.x .safetensors in LDM layout; tokenizer at path.parent / 'tokenizers'."""
    return _tiny(tiny_models_dir, "sd1", "single_file")


@pytest.fixture(scope="session")
def tiny_sd1_diffusers(tiny_models_dir):
    """Tiny SD1.x diffusers folder (tokenizer inside; same weights as tiny_sd1_single_file)."""
    return _tiny(tiny_models_dir, "sd1", "diffusers")


@pytest.fixture(scope="session")
def tiny_dataset_dir(tmp_path_factory):
    """A --train_data_dir with 2_demo/img_{0..3}.png + .txt captions (64x64, shapes on gradients)."""
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("tiny_dataset"), n=4, size=(64, 64), repeats=2, name="demo")


@pytest.fixture(scope="session")
def anima_set(tmp_path_factory):
    """A tiny random Anima (library.anima_models.make_tiny_anima: the DiT in upstream's layout, Qwen3 as a file and a
    folder, the VAE, local tokenizers); tests/test_anima*.py."""
    from library import anima_models

    return anima_models.make_tiny_anima(tmp_path_factory.mktemp("anima_models"))


@pytest.fixture(scope="session")
def anima_data(tmp_path_factory):
    """Two captioned 32x32 images for the Anima tests."""
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("anima_data"), n=2, size=(32, 32), repeats=1, name="demo")


def load_tiny_components(path, family):
    """SD components of a tiny single file made by the fixtures above (its tokenizers beside it)."""
    from library.model_util import load_sd_components

    return load_sd_components(str(path), family, tokenizer_cache_dir=str(path.parent / "tokenizers"))


@pytest.fixture(scope="module")
def tiny_sd1(tiny_sd1_single_file):
    """The tiny SD1 model loaded (once per test module: tests that change it restore it)."""
    return load_tiny_components(tiny_sd1_single_file, "sd1")


@pytest.fixture(scope="module")
def tiny_sdxl(tiny_sdxl_single_file):
    return load_tiny_components(tiny_sdxl_single_file, "sdxl")


def pytest_collection_modifyitems(config, items):
    """A test that drives the browser (the `page` fixture of test_gui_e2e) is a `browser` test: `-m "not browser"`
    leaves them out."""
    for item in items:
        if "page" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)
            # a test of several waits on a loaded 2-core machine: each wait ends on the page's state (180 s at
            # most); the whole test may take longer than the suite's 600 s
            item.add_marker(pytest.mark.timeout(1800))


@pytest.fixture
def writes_fail_past():
    """`with writes_fail_past(n):` every write past byte n of a file fails with EFBIG ("File too large"): a disk
    that refuses a save halfway, for the real writers (RLIMIT_FSIZE; SIGXFSZ ignored so the write returns the
    error instead of killing the process)."""
    import contextlib
    import resource
    import signal

    @contextlib.contextmanager
    def limit(nbytes: int):
        old = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old)
            signal.signal(signal.SIGXFSZ, handler)

    return limit
