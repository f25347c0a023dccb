"""Losses read one step late (library.late_loss) and the training loop that reports them under their own steps."""
from __future__ import annotations

import pytest
import torch

from library.late_loss import LateLosses

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_step_is_read_once_the_next_one_is_queued_and_flush_reads_the_rest():
    late = LateLosses("cpu")
    late.add(torch.tensor(1.0))
    late.add(torch.tensor(2.0))  # two micro-steps (gradient accumulation) of step 1
    assert late.step_done("step 1") == []  # nothing read while step 1 may still run
    late.add(torch.tensor(3.0))
    assert late.step_done("step 2") == [("step 1", [1.0, 2.0])]
    late.add(torch.tensor(4.0))
    assert late.step_done("step 3") == [("step 2", [3.0])]
    assert late.flush() == [("step 3", [4.0])]
    assert late.flush() == []


def test_the_value_is_the_one_at_add_time():
    late = LateLosses("cpu")
    loss = torch.tensor(0.5)
    late.add(loss)
    late.step_done(1)
    loss.add_(1.0)  # a buffer reused by the next step must not change the recorded value
    assert late.flush() == [(1, [0.5])]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copies_through_pinned_buffers_that_are_reused():
    late = LateLosses("cuda")
    for i in range(4):
        late.add(torch.tensor(float(i), device="cuda") * 2)
        late.step_done(i)
    assert late.flush() == [(3, [6.0])]
    assert len(late._free) >= 1


@pytest.mark.slow
def test_every_step_reaches_the_trackers_under_its_own_step(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir,
                                                          monkeypatch):
    """3 optimizer steps x 2 micro-steps: each step's loss/current is the last of its own micro-step losses, its
    loss/average the mean of them so far, and the steps arrive in order (wandb drops a step lower than the last)."""
    from pathlib import Path

    import accelerate
    import sdxl_train_network

    from library import network_trainer

    logged = []
    monkeypatch.setattr(accelerate.Accelerator, "log", lambda self, values, step=None, **kw: logged.append(
        (step, dict(values))))
    argv = ["--pretrained_model_name_or_path", str(tiny_sdxl_single_file), "--train_data_dir", str(tiny_dataset_dir),
            "--tokenizer_cache_dir", str(Path(tiny_sdxl_single_file).parent / "tokenizers"),
            "--output_dir", str(tmp_path), "--output_name", "late", "--resolution", "64", "--network_module",
            "networks.lora", "--network_dim", "4", "--max_train_steps", "3", "--learning_rate", "1e-3",
            "--gradient_accumulation_steps", "2", "--network_train_unet_only", "--cache_latents",
            "--cache_text_encoder_outputs", "--max_data_loader_n_workers", "0", "--seed", "1",
            "--logging_dir", str(tmp_path / "logs")]
    trainer = sdxl_train_network.trainer()
    network_trainer.run(trainer, sdxl_train_network.setup_parser(), argv)
    steps = [(step, v) for step, v in logged if "loss/current" in v]
    assert [s for s, _ in steps] == [1, 2, 3]
    assert len(trainer.losses) == 6
    for step, values in steps:
        mine = trainer.losses[2 * step - 2: 2 * step]
        assert values["loss/current"] == pytest.approx(mine[-1])
        assert values["loss/average"] == pytest.approx(sum(trainer.losses[:2 * step]) / (2 * step))
        assert "lr/unet" in values or any(k.startswith("lr/") for k in values)


@pytest.mark.slow
def test_nan_in_freshly_encoded_latents_becomes_zeros_with_upstreams_warning(tmp_path, tiny_sdxl_single_file,
                                                                            tiny_dataset_dir, monkeypatch, capsys):
    from pathlib import Path

    import sdxl_train_network

    from library import network_trainer

    trainer = sdxl_train_network.trainer()
    seen = []

    def nan_latents(*a, **k):
        latents = encode(*a, **k)
        latents[0, 0, 0, 0] = float("nan")
        return latents

    def training_step(state, batch, **kw):
        loss = step(state, batch, **kw)
        seen.append(bool(torch.isfinite(loss)))
        return loss

    step = trainer.training_step
    encode = trainer.family.encode_images
    monkeypatch.setattr(trainer.family, "encode_images", nan_latents)
    monkeypatch.setattr(trainer, "training_step", training_step)
    argv = ["--pretrained_model_name_or_path", str(tiny_sdxl_single_file), "--train_data_dir", str(tiny_dataset_dir),
            "--tokenizer_cache_dir", str(Path(tiny_sdxl_single_file).parent / "tokenizers"),
            "--output_dir", str(tmp_path), "--output_name", "nan", "--resolution", "64", "--network_module",
            "networks.lora", "--network_dim", "4", "--max_train_steps", "1", "--network_train_unet_only",
            "--max_data_loader_n_workers", "0"]
    network_trainer.run(trainer, sdxl_train_network.setup_parser(), argv)
    assert "NaN found in latents, replacing with zeros" in capsys.readouterr().out
    assert seen == [True]
