"""Configuration: TOML + overrides into typed dataclasses; bad input fails early in one line."""

from pathlib import Path
from typing import get_args

import pytest

from titan_vlm import config
from titan_vlm.config import ConfigError, load_config, world_size_of
from titan_vlm.config_schema import choices, key_types
from titan_vlm.parallel_dims import ParallelDims
from titan_vlm.validate import validate_job

DEFAULT = "train_configs/vlm_cp.toml"


def test_default_config_and_overrides():
    cfg = load_config(
        [
            "--config",
            DEFAULT,
            "--parallelism.context_parallel_degree=4",
            "--training.steps",
            "50",
            "--training.seed=7",
            "--job.dump_folder=out/",
            "--training.lr=1e-4",
            "--metrics.enable_tensorboard=false",
        ]
    )
    assert cfg.parallelism.context_parallel_degree == 4
    assert cfg.training.steps == 50 and cfg.training.seed == 7 and cfg.training.lr == 1e-4
    assert cfg.job.dump_folder == "out/" and cfg.metrics.enable_tensorboard is False
    assert world_size_of(cfg) == 4
    validate_job(cfg, 4)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--training.stepz=3"], "training.stepz"),
        (["--trainer.steps=3"], "trainer.steps"),
        (["--training.steps=many"], "training.steps"),
        (["--training.lr=fast"], "training.lr"),
        (["--config", "no/such/file.toml"], "no/such/file.toml"),
        (["training.steps=3"], "training.steps=3"),
        (["--training.steps", "--training.seed=3"], "needs a value"),
        (["--config", "--training.steps=3"], "'--config' needs a file"),
    ],
)
def test_bad_keys_and_values_name_the_key(argv, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")) as e:
        load_config(argv)
    assert "\n" not in str(e.value)


def test_unknown_key_in_toml_names_file_and_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = 3\nlearning_rate = 1.0\n")
    with pytest.raises(ConfigError, match=r"bad\.toml.*training\.learning_rate"):
        load_config(["--config", str(bad)])


@pytest.mark.parametrize(
    "overrides, world, words",
    [
        (["--parallelism.context_parallel_degree=2"], 3, "world size is 3"),
        (
            ["--parallelism.tensor_parallel_degree=2", "--parallelism.context_parallel_degree=2"],
            2,
            "world size is 2",
        ),
        (["--parallelism.tensor_parallel_degree=0"], 1, "tensor_parallel_degree must be >= 1"),
        (["--parallelism.context_parallel_degree=0"], 1, "context_parallel_degree must be >= 1"),
        (
            [
                "--parallelism.data_parallel_shard_degree=-1",
                "--parallelism.context_parallel_degree=2",
            ],
            3,
            "not divisible",
        ),
    ],
)
def test_impossible_degrees_fail_before_any_collective(overrides, world, words):
    cfg = load_config(overrides)
    with pytest.raises(ConfigError, match=words):
        ParallelDims.from_config(cfg, world)


def test_bare_bool_flag_means_true():
    cfg = load_config(["--metrics.enable_tensorboard", "--training.steps=5", "--data.blank_images"])
    assert (
        cfg.metrics.enable_tensorboard is True
        and cfg.data.blank_images is True
        and cfg.training.steps == 5
    )


def test_auto_dp_shard_takes_the_rest():
    cfg = load_config(
        ["--parallelism.data_parallel_shard_degree=-1", "--parallelism.context_parallel_degree=2"]
    )
    assert ParallelDims.from_config(cfg, 8).dp_shard == 4


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["--training.seq_len=16"], "training.seq_len"),
        (["--checkpoint.interval=0"], "checkpoint.interval"),
        (["--data.dataset=/data/x.jsonl"], "data.dataset"),
        (["--metrics.log_freq=0"], "metrics.log_freq"),
        (["--training.lr=nan"], "training.lr"),
        (["--training.min_lr_ratio=7"], "training.min_lr_ratio"),
        (["--training.warmup_steps=-1"], "training.warmup_steps"),
        (["--model.attention_kernel=cuda_flash"], "model.attention_kernel=cuda_flash runs on cuda"),
        (["--data.images_per_sample=9", "--training.seq_len=128"], "training.seq_len"),
    ],
)
def test_model_and_data_checks(overrides, words):
    cfg = load_config(overrides)
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        validate_job(cfg, 1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--model.flavor=huge"],
            "model.flavor must be one of debug, debug_moe, small, llava7b, hf, got 'huge'",
        ),
        (
            ["--training.mixed_precision=fp8"],
            "training.mixed_precision must be one of fp32, bf16, got 'fp8'",
        ),
        (
            ["--parallelism.cp_vision=gpu0"],
            "parallelism.cp_vision must be one of replicate, broadcast, shard, got 'gpu0'",
        ),
        (
            ["--parallelism.cp_comm_type=nccl"],
            "parallelism.cp_comm_type must be one of p2p, allgather, a2a, got 'nccl'",
        ),
        (
            ["--model.image_attention=full"],
            "model.image_attention must be one of causal, bidirectional, got 'full'",
        ),
    ],
)
def test_a_choice_key_takes_one_of_its_names(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    assert str(e.value) == message


def test_rows_must_fit_the_rope_table():
    """Positions restart at every sample and CP padding takes no position, so seq_len is the
    bound."""
    validate_job(cfg := load_config(["--training.seq_len=65536"]), 1)
    cfg = load_config(["--training.seq_len=65537", "--parallelism.context_parallel_degree=16"])
    with pytest.raises(ConfigError, match=r"training.seq_len=65537 exceeds the RoPE table"):
        validate_job(cfg, 16)


def test_a2a_needs_heads_divisible_by_cp():
    cfg = load_config(["--parallelism.cp_comm_type=a2a", "--parallelism.context_parallel_degree=8"])
    with pytest.raises(ConfigError, match=r"cp_comm_type='a2a' needs the 4 attention heads"):
        validate_job(cfg, 8)


def check(*argv: str) -> tuple[int, str, str]:
    """`python -m titan_vlm.launch --check <argv>` run in this process (its main; the subprocess
    run is tests/test_failure_keys.py's): (exit code, stdout, stderr)."""
    import contextlib
    import io
    from unittest import mock

    from titan_vlm.launch import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with (
        mock.patch("sys.argv", ["titan_vlm.launch", "--check", *argv]),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            main()
        except SystemExit as e:
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_restarts_need_checkpoints():
    code, _, err = check("--config", DEFAULT, "--job.max_restarts=2", "--checkpoint.enable=false")
    assert code == 2 and "job.max_restarts needs checkpoint.enable" in err
    # the default run checkpoints
    code, out, _ = check("--config", DEFAULT, "--job.max_restarts=2")
    assert code == 0 and out.split() == ["2", "2"]


def test_config_cli_prints_process_count_or_one_line_error():
    code, out, _ = check("--config", DEFAULT, "--parallelism.context_parallel_degree=4")
    assert code == 0 and out.split() == ["4", "0"]  # processes, job.max_restarts
    code, _, err = check("--config", DEFAULT, "--training.stepz=1")
    assert code == 2
    assert err.strip().count("\n") == 0 and "training.stepz" in err


def test_tensor_and_sequence_parallel_keys():
    cfg = load_config(["--config", "train_configs/vlm_cp_tp.toml"])
    p = cfg.parallelism
    assert (p.data_parallel_shard_degree, p.context_parallel_degree, p.tensor_parallel_degree) == (
        2,
        2,
        2,
    )
    assert p.enable_sequence_parallel is True and p.image_embed_tp_shard is False
    assert world_size_of(cfg) == 8
    validate_job(cfg, 8)
    cfg = load_config(
        [
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.image_embed_tp_shard",
            "--parallelism.cp_comm_type=a2a",
            "--parallelism.context_parallel_degree=2",
        ]
    )
    assert (
        cfg.parallelism.image_embed_tp_shard is True
        and cfg.parallelism.enable_sequence_parallel is False
    )
    validate_job(cfg, 4)  # 4 heads / tp 2 = 2 per rank, split over cp 2


@pytest.mark.parametrize(
    "overrides, world, words",
    [
        (
            ["--parallelism.enable_sequence_parallel"],
            1,
            "parallelism.enable_sequence_parallel needs parallelism.tensor_parallel_degree > 1",
        ),
        (
            ["--parallelism.image_embed_tp_shard=true"],
            1,
            "parallelism.image_embed_tp_shard needs parallelism.tensor_parallel_degree > 1",
        ),
        (
            ["--parallelism.tensor_parallel_degree=3"],
            3,
            r"tensor_parallel_degree=3 does not divide the decoder n_heads \(4\)",
        ),
        (
            ["--parallelism.tensor_parallel_degree=4"],
            4,
            r"does not divide the decoder n_kv_heads \(2\)",
        ),
        (
            [
                "--parallelism.tensor_parallel_degree=2",
                "--parallelism.cp_comm_type=a2a",
                "--parallelism.context_parallel_degree=4",
            ],
            8,
            r"cp_comm_type='a2a' needs the 2 attention heads per tp rank "
            r"\(4 / tensor_parallel_degree=2\)",
        ),
        (
            ["--parallelism.enable_sequence_parallel=maybe"],
            1,
            "parallelism.enable_sequence_parallel: expected bool",
        ),
    ],
)
def test_tensor_parallel_checks_name_the_key(overrides, world, words):
    with pytest.raises(ConfigError, match=words) as e:
        cfg = load_config(overrides)
        validate_job(cfg, world)
    assert "\n" not in str(e.value)


def test_choice_literals_name_what_the_registries_hold():
    """One registry per choice: a choice-valued key's Literal (config.py, which imports none of
    these modules) lists exactly the names its runtime registry knows."""
    from torch._dynamo import list_backends

    from titan_vlm.data.bad_samples import BAD_SAMPLE_MODES
    from titan_vlm.kernels import KERNELS
    from titan_vlm.layout import IMAGE_TOKEN_MODES, SAMPLE_PLACEMENTS
    from titan_vlm.models.llava.args import FLAVORS, IMAGE_ATTENTION
    from titan_vlm.models.registry import MODEL_SPECS
    from titan_vlm.parallel import parallelize
    from titan_vlm.parallel.context_parallel import CP_VISION_MODES
    from titan_vlm.parallel.cp_attention import CP_ATTENTION
    from titan_vlm.plan import memory

    def names(literal):
        return set(get_args(literal))

    assert names(config.CPCommType) == set(CP_ATTENTION)
    assert names(config.AttentionKernel) == {"auto", *KERNELS}
    assert names(config.CPVision) == set(CP_VISION_MODES)
    assert names(config.ACMode) == set(parallelize.AC_MODES) == set(memory.AC_MODES)
    assert names(config.ModelName) == set(MODEL_SPECS)
    assert names(config.Flavor) == {*FLAVORS, "hf"}
    assert names(config.ImageAttention) == set(IMAGE_ATTENTION)
    assert names(config.OnBadSample) == set(BAD_SAMPLE_MODES)
    assert names(config.CPSamplePlacement) == set(SAMPLE_PLACEMENTS)
    assert names(config.CPImageTokens) == set(IMAGE_TOKEN_MODES)
    assert names(config.CompileBackend) <= set(list_backends(exclude_tags=()))


def test_every_choice_key_accepts_each_name_and_refuses_others(tmp_path):
    """Generated from the Literal types: every name loads, from the command line and TOML; any
    other value (a TOML number too) is one line naming the key, its names and, from a file, the
    file."""
    for section, section_type in config.sections().items():
        for key, typ in key_types(section_type).items():
            names = choices(typ)
            if names is None:
                continue
            for name in names:
                cfg = load_config([f"--{section}.{key}={name}"])
                assert getattr(getattr(cfg, section), key) == name
            with pytest.raises(ConfigError) as e:
                load_config([f"--{section}.{key}=nope"])
            assert str(e.value) == (
                f"{section}.{key} must be one of {', '.join(names)}, got 'nope'"
            )
            toml = tmp_path / "c.toml"
            toml.write_text(f"[{section}]\n{key} = 1\n")
            with pytest.raises(ConfigError) as e:
                load_config(["--config", str(toml)])
            assert (
                str(e.value) == f"{toml}: {section}.{key} must be one of {', '.join(names)}, got 1"
            )


def test_a_choice_changed_in_code_is_checked_before_the_run():
    cfg = load_config([])
    cfg.parallelism.cp_comm_type = "ring"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="parallelism.cp_comm_type must be one of p2p, allgather"):
        validate_job(cfg, 1)


def test_the_train_configs_load():
    """Each loads; each but the recipes, which name folders and files of the user's own (run on
    tiny ones by tests/test_recipes.py), validates; a recipe stops at its first missing one."""
    from test_recipes import RECIPES

    for path in sorted(Path("train_configs").glob("*.toml")):
        cfg = load_config(["--config", str(path)])
        if path.name in RECIPES:
            with pytest.raises(ConfigError, match=r"^model\.hf_\w+: .*checkpoints/"):
                validate_job(cfg, world_size_of(cfg))
        else:
            validate_job(cfg, world_size_of(cfg))
