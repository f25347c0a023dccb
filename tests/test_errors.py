"""library.errors: one base error class for every 'bad settings or inputs' kind; the run catches that one type."""
import inspect
import pytest

from library import errors, network_trainer, train_util


def _kinds():
    return [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == "library.errors"]


def test_every_error_kind_derives_from_the_one_base():
    kinds = _kinds()
    assert len(kinds) >= 14
    for cls in kinds:
        assert issubclass(cls, errors.UserError), cls


def test_the_old_names_are_the_bottom_layer_classes():
    from library import block_swap, dataset_files, flux_models, model_util, sample_prompts, saving
    from library.compile import options as compile_options
    from networks import lora, lora_blocks

    assert train_util.ConfigError is errors.ConfigError
    assert train_util.OptionalPackageError is errors.OptionalPackageError
    assert train_util.OutputExistsError is errors.OutputExistsError
    assert network_trainer.TrainingError is errors.TrainingError
    assert saving.SaveError is errors.SaveError
    assert model_util.ModelLoadError is errors.ModelLoadError
    assert flux_models.FluxModelError is errors.FluxModelError
    assert compile_options.CompileConfigError is errors.CompileConfigError
    assert sample_prompts.PromptFileError is errors.PromptFileError
    assert dataset_files.DatasetError is errors.DatasetError
    assert block_swap.BlockSwapError is errors.BlockSwapError
    assert lora.NetworkArgsError is errors.NetworkArgsError
    assert lora_blocks.BlockArgsError is errors.BlockArgsError
    # code that caught the standard bases still catches them
    assert issubclass(errors.ConfigError, ValueError) and issubclass(errors.OutputExistsError, FileExistsError)


def test_errors_imports_nothing_from_the_library():
    source = inspect.getsource(errors)
    assert "import" not in source.replace('"""', "").split("class UserError")[1]
    assert not [line for line in source.splitlines() if line.startswith(("import ", "from "))]


@pytest.mark.parametrize("cls", [errors.BlockSwapError, errors.FluxModelError, errors.SaveError])
def test_run_turns_any_kind_into_one_line_and_exit_2(cls, capsys, monkeypatch):
    class Failing:
        def train(self, args):
            raise cls("the message naming --the_flag")

    monkeypatch.setattr(train_util, "parse_args", lambda parser, argv: None)
    with pytest.raises(SystemExit) as e:
        network_trainer.run(Failing(), None, [])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "error: the message naming --the_flag"
