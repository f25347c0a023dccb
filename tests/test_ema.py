"""EMA of the trained weights (library.ema, --ema_decay): the average follows the decay with OneTrainer's warm-up,
on the training device or the CPU, every N steps; swapping it in and out leaves the raw weights exact; its state
round-trips; a LoRA run saves the EMA as the model (and the raw weights with --ema_save_raw) with the values the
decay gives, records it in the metadata, and --save_state / --resume continue it exactly."""
from __future__ import annotations

import argparse
import contextlib
import json

import pytest
import torch

from library import ema

pytestmark = pytest.mark.usefixtures("one_thread")


def _expected(history, decay):
    """The average by its definition: s_0 = w_0, s_k = d_k * s_(k-1) + (1 - d_k) * w_k, d_k = min(decay,
    (1 + k') / (10 + k')) for the k'-th update (0-based)."""
    s = history[0].clone()
    for k, w in enumerate(history[1:]):
        d = min(decay, (1 + k) / (10 + k))
        s = d * s + (1 - d) * w
    return s


@pytest.mark.parametrize("device", ["gpu", "cpu"])
def test_average_follows_the_decay_with_warmup(device):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3))
    q = torch.nn.Parameter(torch.randn(7))
    avg = ema.EMA([p, q], decay=0.9, device=device)
    hist_p, hist_q = [p.detach().clone()], [q.detach().clone()]
    for _ in range(30):
        with torch.no_grad():
            p.add_(torch.randn_like(p))
            q.mul_(1.1)
        hist_p.append(p.detach().clone())
        hist_q.append(q.detach().clone())
        avg.update()
    assert torch.allclose(avg.shadow[0], _expected(hist_p, 0.9), atol=1e-5)
    assert torch.allclose(avg.shadow[1], _expected(hist_q, 0.9), atol=1e-5)
    assert avg.shadow[0].device.type == "cpu"
    assert avg.decay_at(0) == pytest.approx(0.1) and avg.decay_at(1000) == 0.9  # warm-up, then the decay
    assert not torch.allclose(avg.shadow[0], p)  # the average lags the raw weights


def test_swap_in_and_out_and_state_round_trip():
    p = torch.nn.Parameter(torch.arange(6.0))
    avg = ema.EMA([p], decay=0.5)
    with torch.no_grad():
        p.add_(10)
    avg.update()
    raw = p.detach().clone()
    with avg.swapped_in():
        assert torch.equal(p.detach(), avg.shadow[0])
    assert torch.equal(p.detach(), raw)
    other = ema.EMA([torch.nn.Parameter(torch.zeros(6))], decay=0.5)
    other.load_state_dict(avg.state_dict())
    assert torch.equal(other.shadow[0], avg.shadow[0]) and other.updates == 1
    from library.errors import TrainingError

    with pytest.raises(TrainingError, match="EMA does not fit"):
        ema.EMA([torch.nn.Parameter(torch.zeros(3))], decay=0.5).load_state_dict(avg.state_dict())


def test_update_every_n_steps_as_a_step_event():
    from types import SimpleNamespace

    p = torch.nn.Parameter(torch.zeros(2))
    state = SimpleNamespace(ema=ema.EMA([p], 0.9, update_every=3), at_epoch_end=False, global_step=0)
    event = ema.EMAUpdate()
    due = []
    for step in range(1, 10):
        state.global_step = step
        due.append(event.due(state))
        if due[-1]:
            event.run(state)
    assert due == [False, False, True] * 3 and state.ema.updates == 3
    state.at_epoch_end = True
    assert not event.due(state)
    assert not event.due(SimpleNamespace(ema=None, at_epoch_end=False, global_step=3))


@pytest.mark.parametrize("sample_raw", [False, True])
def test_samples_are_drawn_with_the_average(sample_raw):
    """Trainer.sample_images runs the family's sampler with the EMA swapped in (and with --ema_sample_raw again
    with the raw weights, under <output_name>-raw); the raw weights are back after."""
    from types import SimpleNamespace

    from library.run.trainer import Trainer

    p = torch.nn.Parameter(torch.ones(3))
    avg = ema.EMA([p], 0.5)
    with torch.no_grad():
        p.mul_(5)
    seen = []
    trainer = Trainer.__new__(Trainer)
    trainer.family = SimpleNamespace(sample=lambda args, *a, **k: seen.append((args.output_name,
                                                                              p.detach().clone())))
    trainer.target = SimpleNamespace(sample_args=lambda args: args)  # a LoRA target: the prompts as given
    trainer.eval_weights = lambda state: contextlib.nullcontext()
    args = argparse.Namespace(sample_prompts="p.txt", output_name="run", ema_sample_raw=sample_raw)
    state = SimpleNamespace(args=args, ema=avg, components=None,
                            accelerator=SimpleNamespace(is_main_process=True, unwrap_model=lambda m: m),
                            trainable=SimpleNamespace(models=[]), global_step=1, prediction_type="epsilon")
    trainer.sample_images(state, epoch=None)
    assert [name for name, _ in seen] == (["run", "run-raw"] if sample_raw else ["run"])
    assert torch.equal(seen[0][1], torch.ones(3)) and torch.equal(p.detach(), torch.full((3,), 5.0))
    if sample_raw:
        assert torch.equal(seen[1][1], torch.full((3,), 5.0))


def test_bad_values_are_one_line(tiny_sd1_single_file, tmp_path, capsys):
    import train_network

    for extra, message in ((["--ema_decay", "1.5"], "--ema_decay 1.5: must be between 0 and 1"),
                           (["--ema_decay", "0.9", "--ema_update_every", "0"], "--ema_update_every 0: must be 1")):
        with pytest.raises(SystemExit) as e:
            train_network.main(["--pretrained_model_name_or_path", str(tiny_sd1_single_file), "--train_data_dir",
                                str(tmp_path), "--output_dir", str(tmp_path / "o"), *extra])
        assert e.value.code == 2 and message in capsys.readouterr().err


# -- a LoRA run ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_image(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("ema_img"), n=1, size=(64, 64), repeats=1, name="one")


def _argv(model, data, out, name, extra=()):
    return ["--pretrained_model_name_or_path", str(model), "--tokenizer_cache_dir", str(model.parent / "tokenizers"),
            "--train_data_dir", str(data), "--output_dir", str(out), "--output_name", name,
            "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "4", "--resolution", "64",
            "--max_train_steps", "3", "--learning_rate", "1e-2", "--max_data_loader_n_workers", "0", "--seed", "3",
            "--network_train_unet_only", "--ema_decay", "0.5", *extra]


@pytest.mark.slow
def test_lora_run_saves_the_average_as_the_decay_says(tiny_sd1_single_file, one_image, tmp_path):
    """Each step's raw weights (--ema_save_raw, saved every step) give the EMA saved at each step: the lora_up
    weights start at 0, so s_k = d_k s_(k-1) + (1 - d_k) w_k is known from the raw files alone."""
    import train_network
    from lora_checks import read_lora

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2 --d 5\n")
    out = train_network.main(_argv(tiny_sd1_single_file, one_image, tmp_path, "e",
                                   ["--ema_save_raw", "--save_every_n_steps", "1", "--sample_prompts", str(prompts),
                                    "--sample_every_n_steps", "3", "--ema_sample_raw"]))
    # samples with the EMA weights and with the raw ones, and they differ
    ema_png, = (tmp_path / "sample").glob("e_000003_00_*_5.png")
    raw_png, = (tmp_path / "sample").glob("e-raw_000003_00_*_5.png")
    assert ema_png.read_bytes() != raw_png.read_bytes()
    raws = [read_lora(tmp_path / f"e-step{s:08d}-raw.safetensors")[0] for s in (1, 2, 3)]
    emas = [read_lora(tmp_path / f"e-step{s:08d}.safetensors")[0] for s in (1, 2)] + [read_lora(out)[0]]
    final_md = read_lora(out)[1]
    assert final_md["ss_ema_decay"] == "0.5" and final_md["ss_ema_update_every"] == "1"
    assert (tmp_path / "e-raw.safetensors").is_file()
    ups = [k for k in raws[0] if k.endswith("lora_up.weight")]
    assert ups
    for k in ups:
        s = torch.zeros_like(raws[0][k])
        for step, (raw, saved) in enumerate(zip(raws, emas)):
            d = min(0.5, (1 + step) / (10 + step))
            s = d * s + (1 - d) * raw[k]
            assert torch.allclose(saved[k], s, atol=1e-6), (k, step)
        assert not torch.allclose(emas[-1][k], raws[-1][k], atol=1e-7)


@pytest.mark.slow
def test_save_state_and_resume_carry_the_average(tiny_sd1_single_file, one_image, tmp_path):
    import train_network
    from lora_checks import read_lora

    whole = train_network.main(_argv(tiny_sd1_single_file, one_image, tmp_path / "a", "w"))
    train_network.main(_argv(tiny_sd1_single_file, one_image, tmp_path / "b", "r",
                             ["--max_train_steps", "2", "--save_state"]))
    resumed = train_network.main(_argv(tiny_sd1_single_file, one_image, tmp_path / "b", "r",
                                       ["--resume", str(tmp_path / "b" / "r-state"), "--overwrite_output"]))
    want, got = read_lora(whole)[0], read_lora(resumed)[0]
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-6), k
    assert json.loads(json.dumps(read_lora(resumed)[1]))["ss_ema_decay"] == "0.5"


@pytest.mark.slow
def test_full_finetune_saves_the_average(tiny_sd1_single_file, one_image, tmp_path):
    """train_db.py with --ema_decay 0.5 --ema_device cpu --ema_save_raw: the saved model is the average (it
    differs from the raw weights and lies nearer the base model than they do)."""
    import train_db
    from safetensors.torch import load_file

    out = train_db.main(["--pretrained_model_name_or_path", str(tiny_sd1_single_file), "--tokenizer_cache_dir",
                         str(tiny_sd1_single_file.parent / "tokenizers"), "--train_data_dir", str(one_image),
                         "--output_dir", str(tmp_path), "--output_name", "db", "--resolution", "64",
                         "--max_train_steps", "2", "--learning_rate", "1e-3", "--max_data_loader_n_workers", "0",
                         "--seed", "3", "--ema_decay", "0.5", "--ema_device", "cpu", "--ema_save_raw",
                         "--stop_text_encoder_training", "-1"])
    avg, raw, base = load_file(str(out)), load_file(str(tmp_path / "db-raw.safetensors")), \
        load_file(str(tiny_sd1_single_file))
    changed = [k for k in raw if k in base and not torch.equal(raw[k], base[k])]
    assert changed
    for k in changed[:20]:
        assert not torch.equal(avg[k], raw[k])
        # s_2 = d_1 (d_0 w0 + (1 - d_0) w1) + (1 - d_1) w2: between the base and the raw weights here
        assert (avg[k].float() - base[k].float()).norm() < (raw[k].float() - base[k].float()).norm()
