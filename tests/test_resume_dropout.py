"""Issue 26 item 5: --resume is bit-exact with --network_dropout: the dropout masks of the resumed steps are the
ones the uninterrupted run drew (the global RNG that dropout draws from is restored at the first resumed step,
not before the data loader of the resumed epoch has drawn from it)."""
from __future__ import annotations

import pytest
import torch

from lora_checks import read_lora
from test_sdxl_lora_training import base_argv

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
@pytest.mark.parametrize("dropout,steps,saved", [
    (["--network_dropout", "0.5"], 3, 2),  # mid-epoch (8 steps per epoch)
    (["--network_dropout", "0.3", "--network_args", "rank_dropout=0.3", "module_dropout=0.3"], 3, 2),
    (["--network_dropout", "0.5"], 10, 8),  # at an epoch's end
])
def test_resume_with_dropout_is_bit_exact(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir, dropout, steps, saved):
    import sdxl_train_network
    from library import network_trainer

    def run(name, extra):
        return network_trainer.run(sdxl_train_network.trainer(), sdxl_train_network.setup_parser(),
                                   base_argv(tiny_sdxl_single_file, tmp_path, tiny_dataset_dir, name, steps=steps,
                                             extra=["--network_train_unet_only", *dropout, *extra]))

    full = run("full", ["--save_every_n_steps", str(saved), "--save_state"])
    resumed = run("resumed", ["--resume", str(tmp_path / f"full-step{saved:08d}-state")])
    a, _ = read_lora(full)
    b, md = read_lora(resumed)
    assert md["ss_steps"] == str(steps)
    assert all(torch.equal(a[k], b[k]) for k in a), max(float((a[k] - b[k]).abs().max()) for k in a)
