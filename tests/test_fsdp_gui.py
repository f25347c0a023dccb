"""The GUI's Accelerate launch section: the FSDP choice (full trainers) and the fields of a run over several
machines, written into the launch command (kohya_gui/command.py)."""
from __future__ import annotations

from kohya_gui import command
from kohya_gui import params as P


def dreambooth_values(**extra) -> dict:
    return {**P.defaults("dreambooth"), "pretrained_model_name_or_path": "m.safetensors", "train_data_dir": "d",
            "output_dir": "out", "output_name": "x", **extra}


def test_fsdp_choice_is_in_the_accelerate_section_of_the_full_trainers():
    shown = {p.name: p for p in P.params_for("dreambooth", "SDXL")}
    fsdp = shown["fsdp"]
    assert fsdp.accordion == "accelerate" and set(fsdp.choices) >= {"full_shard", "shard_grad_op", "hybrid_shard"}
    assert shown["fsdp_cpu_offload"].accordion == "accelerate" and shown["deepspeed"].accordion == "accelerate"
    assert "fsdp" in {p.name for p in P.params_for("finetune", "FLUX.1")}
    assert "fsdp" not in {p.name for p in P.params_for("lora", "SDXL")}  # LoRA trainers are data parallel


def test_two_machine_fsdp_command():
    values = dreambooth_values(fsdp="full_shard", fsdp_cpu_offload=True, num_processes=16, num_machines=2,
                               machine_rank=1, main_process_ip="10.0.0.1", main_process_port=29500, multi_gpu=True)
    assert command.validation_errors("dreambooth", "SDXL", values) == []
    argv = command.standalone_argv("dreambooth", "SDXL", values)
    launch = argv[:argv.index(command.script_path("dreambooth", "SDXL"))]
    for flag, value in (("--num_processes", "16"), ("--num_machines", "2"), ("--machine_rank", "1"),
                        ("--main_process_ip", "10.0.0.1"), ("--main_process_port", "29500")):
        assert launch[launch.index(flag) + 1] == value, launch
    assert "--multi_gpu" in launch
    trainer = argv[len(launch) + 1:]
    assert trainer[trainer.index("--fsdp") + 1] == "full_shard" and "--fsdp_cpu_offload" in trainer

    import sdxl_train  # the trainer reads them back as the GUI wrote them
    from library import train_util

    args = train_util.parse_args(sdxl_train.setup_parser(), trainer)
    assert args.fsdp == "full_shard" and args.fsdp_cpu_offload


def test_machine_fields_are_checked_before_a_run():
    values = dreambooth_values(num_processes=4, num_machines=2, machine_rank=2)
    errors = command.validation_errors("dreambooth", "SDXL", values)
    assert any("main_process_ip" in e for e in errors), errors
    assert any("machine_rank" in e and "below" in e for e in errors), errors
    errors = command.validation_errors("dreambooth", "SDXL", {**values, "num_processes": 3, "machine_rank": 0,
                                                               "main_process_ip": "10.0.0.1"})
    assert len(errors) == 1 and "does not divide over 2 machines" in errors[0], errors
