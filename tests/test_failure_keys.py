"""The config of what the job does when things go wrong: TOML values of the wrong type are
errors (before, `steps = "3"` was silently taken as an int), and the new keys are checked."""

import pytest
from cli import python_m

from titan_vlm.config import ConfigError, load_config, validate_failure_keys


@pytest.mark.parametrize(
    "line, named",
    [
        ('steps = "3"', "training.steps: expected int, got the string '3'"),
        ('lr = "1e-3"', "training.lr: expected float, got the string '1e-3'"),
    ],
)
def test_a_toml_string_for_a_number_is_an_error(tmp_path, line, named):
    toml = tmp_path / "c.toml"
    toml.write_text(f"[training]\n{line}\n")
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(toml)])
    assert str(e.value) == f"{toml}: {named} (TOML: write it without quotes)"
    assert load_config(["--training.steps", "3"]).training.steps == 3  # command line: strings


def test_a_toml_string_stops_run_train_before_torchrun(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[training]\nsteps = "3"\n')
    out = python_m("titan_vlm.launch", "--check", "--config", str(toml))
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0
    assert "training.steps: expected int" in out.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["--checkpoint.keep=-1"], "checkpoint.keep must be >= 0"),
        (["--data.max_empty_steps=0"], "data.max_empty_steps must be >= 1"),
        (["--job.max_restarts=1", "--checkpoint.enable=false"], "needs checkpoint.enable"),
    ],
)
def test_failure_keys_are_checked(args, words):
    with pytest.raises(ConfigError, match=words):
        validate_failure_keys(load_config(args))


def test_on_nonfinite_is_stop_or_skip():
    with pytest.raises(ConfigError, match="training.on_nonfinite must be one of stop, skip"):
        load_config(["--training.on_nonfinite=ignore"])


def test_failure_key_defaults():
    cfg = load_config([])
    assert cfg.training.on_nonfinite == "stop" and cfg.checkpoint.keep == 3
    assert cfg.data.max_empty_steps == 3 and cfg.checkpoint.allow_config_change is False
