"""RewardConfig: construction styles, YAML and overrides, errors that say what to change."""

import copy
import json
import pickle
from pathlib import Path

import pytest
import yaml

from rewardax.config import (
    SECTIONS,
    MeshSection,
    OptimSection,
    RewardConfig,
    describe_fields,
)
from rewardax.data.config import DataConfig
from rewardax.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "src" / "rewardax" / "configs"


def test_reference_api_flat_keywords_are_routed_to_their_sections():
    config = RewardConfig(
        per_device_train_batch_size=8, learning_rate=2e-5, max_sequence_length=512
    )
    assert config.train.per_device_train_batch_size == 8
    assert config.optim.learning_rate == 2e-5
    assert config.data.max_sequence_length == 512
    assert config.learning_rate == 2e-5  # flat attribute access
    assert config.max_length == 512  # the alias reads too


def test_alias_and_sections_as_objects_or_mappings():
    config = RewardConfig(
        max_length=128, optim={"learning_rate": "1e-5"}, data=DataConfig(truncation_mode="filter")
    )
    assert config.data.max_sequence_length == 128
    assert config.data.truncation_mode == "filter"
    assert config.optim.learning_rate == 1e-5  # parsed from a string
    base = OptimSection(name="lion")
    config = RewardConfig(optim=base, weight_decay=0.1)
    assert (config.optim.name, config.optim.weight_decay) == ("lion", 0.1)
    assert base.weight_decay == 0.0  # the given object is not modified


def test_the_same_field_twice_is_an_error():
    with pytest.raises(ConfigError, match="given twice"):
        RewardConfig(optim={"learning_rate": 1e-5}, learning_rate=2e-5)
    with pytest.raises(ConfigError, match="given twice"):
        RewardConfig(max_length=64, max_sequence_length=128)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"learning_rat": 1e-5}, r"'learning_rat'.*did you mean 'learning_rate'"),
        ({"optim": {"warmup_step": 5}}, r"'optim.warmup_step'.*did you mean 'optim.warmup_steps'"),
        ({"per_device_batch_size": 8}, r"did you mean 'per_device_\w+_batch_size'"),
        ({"disable_dropout": True}, r"unknown configuration key 'disable_dropout'"),
    ],
)
def test_unknown_keys_name_the_key_and_the_closest_valid_one(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        RewardConfig(**kwargs)


def test_a_field_in_the_wrong_section_points_to_the_right_one():
    with pytest.raises(ConfigError, match=r"use optim\.learning_rate"):
        RewardConfig(train={"learning_rate": 1e-5})


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"dtype": "fp16"},
            r"model.dtype must be one of 'auto', 'float32', 'bfloat16'; got 'fp16'",
        ),
        ({"name": "adam"}, r"optim.name must be one of .* \(did you mean 'adamw'\?\)"),
        ({"per_device_train_batch_size": "eight"}, r"must be an integer; got 'eight'"),
        ({"per_device_train_batch_size": 2.5}, r"must be an integer"),
        ({"learning_rate": "fast"}, r"optim.learning_rate must be a number"),
        ({"progress_bar": "maybe"}, r"must be true or false"),
        ({"learning_rate": None}, r"optim.learning_rate cannot be null"),
        ({"report_to": ["tensorboard", "mlflow"]}, r"logging.report_to\[1\] must be one of"),
    ],
)
def test_wrong_types_and_choices_are_config_errors(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        RewardConfig(**kwargs)


def test_setting_attributes_routes_coerces_and_rejects_typos():
    config = RewardConfig()
    config.learning_rate = "3e-4"
    assert config.optim.learning_rate == 3e-4
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        config.learning_rat = 1.0
    with pytest.raises(ConfigError, match=r"did you mean 'optim\.learning_rate'"):
        config.optim.learning_rat = 1.0  # no silent new attributes on a section either
    with pytest.raises(AttributeError):
        _ = config.not_a_field


def test_yaml_sectioned_flat_and_dotted_keys(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "optim:\n  learning_rate: 2e-5\n  schedule: cosine\n"  # 2e-5: a string in YAML 1.1
        "per_device_train_batch_size: 4\n"
        "data.max_length: 96\n"
        "eval:\n"  # an empty section is fine
        "report_to: wandb\n"
    )
    config = RewardConfig.from_yaml(path)
    assert config.optim.learning_rate == 2e-5
    assert isinstance(config.optim.learning_rate, float)
    assert config.optim.schedule == "cosine"
    assert config.train.per_device_train_batch_size == 4
    assert config.data.max_sequence_length == 96
    assert config.logging.report_to == ["wandb"]


def test_yaml_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        RewardConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML"):
        RewardConfig.from_yaml(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- learning_rate\n")
    with pytest.raises(ConfigError, match=r"list\.yaml must hold a mapping"):
        RewardConfig.from_yaml(listed)
    typo = tmp_path / "typo.yaml"
    typo.write_text("optim:\n  learnig_rate: 1.0e-5\n")
    with pytest.raises(ConfigError, match=r"typo.yaml; did you mean 'optim.learning_rate'"):
        RewardConfig.from_yaml(typo)


def test_overrides_are_parsed_by_field_type():
    base = RewardConfig()
    config = base.with_overrides(
        [
            "optim.learning_rate=1e-5",
            "data.max_sequence_length=256",
            "logging.report_to=[tensorboard, wandb]",
            "--eval_at_start=true",
            "optim.max_grad_norm=null",
            "center_rewards_coefficient=0.01",
            "bucket_lengths=[64,128]",
            "model.remat_policy=none",  # a Literal choice, not null
            "matmul_dtype=bfloat16",  # an optional Literal
            "checkpoint.run_name=2024",
            "mesh.dp=2",
        ]
    )
    assert config.optim.learning_rate == 1e-5
    assert config.data.max_sequence_length == 256
    assert config.logging.report_to == ["tensorboard", "wandb"]
    assert config.eval.eval_at_start is True
    assert config.optim.max_grad_norm is None
    assert config.train.center_rewards_coefficient == 0.01
    assert config.data.bucket_lengths == (64, 128)
    assert config.model.remat_policy == "none"
    assert config.model.matmul_dtype == "bfloat16"
    assert base.model.matmul_dtype is None
    assert config.checkpoint.run_name == "2024"
    assert config.mesh.dp == 2
    assert base == RewardConfig()  # with_overrides returns a new config


def test_bad_overrides():
    with pytest.raises(ConfigError, match=r"must look like section\.field=value"):
        RewardConfig().with_overrides(["learning_rate"])
    with pytest.raises(ConfigError, match=r"did you mean 'optim\.warmup_ratio'"):
        RewardConfig().with_overrides(["optim.warmup_ration=0.1"])
    with pytest.raises(ConfigError, match=r"optim\.schedule must be one of"):
        RewardConfig().with_overrides(["optim.schedule=exponential"])


def test_from_yaml_applies_overrides_after_the_file():
    config = RewardConfig.from_yaml(CONFIGS / "tiny.yaml", ["max_training_steps=6"])
    assert config.train.max_training_steps == 6
    assert config.train.per_device_train_batch_size == 2  # from the file


def test_to_dict_round_trips_through_json_and_yaml():
    config = RewardConfig(
        learning_rate=3e-4,
        report_to=["wandb"],
        bucket_lengths=(32, 64),
        center_rewards_coefficient=0.01,
        run_name="x",
    )
    d = config.to_dict()
    assert set(d) == set(SECTIONS)
    assert RewardConfig.from_dict(json.loads(json.dumps(d))) == config
    assert RewardConfig.from_dict(yaml.safe_load(config.to_yaml())) == config
    assert pickle.loads(pickle.dumps(config)) == config
    assert copy.deepcopy(config) == config


def test_every_field_is_documented_exactly_once():
    rows = describe_fields()
    names = [row[0] for row in rows]
    expected = [f"{s}.{name}" for s, cls in SECTIONS.items() for name in cls.model_fields]
    assert names == expected
    for section, cls in SECTIONS.items():
        undocumented = [name for name, text in cls.field_help().items() if not text]
        assert not undocumented, f"{section}: {undocumented}"
    for name, type_name, _default, help_text in rows:
        assert type_name and len(help_text) > 15, name
    row = dict((r[0], r) for r in rows)["optim.warmup_ratio"]
    assert row[1:3] == ("float", 0.0)
    assert row[3].startswith("warmup as a fraction of all optimizer steps (rounded up); set this")
    assert dict((r[0], r) for r in rows)["logging.report_to"][1] == "list['tensorboard' | 'wandb']"


def test_mesh_resolve():
    assert MeshSection().resolve(8) == (8, 1, 1)
    assert MeshSection(dp=-1, fsdp=2, tp=2).resolve(8) == (2, 2, 2)
    assert MeshSection(dp=2, fsdp=-1, tp=1).resolve(8) == (2, 4, 1)
    assert MeshSection(dp=1, fsdp=1, tp=1).resolve(1) == (1, 1, 1)
    with pytest.raises(ConfigError, match="at most one axis"):
        MeshSection(dp=-1, fsdp=-1).resolve(8)
    with pytest.raises(ConfigError, match="= 4 but 8 devices"):
        MeshSection(dp=2, fsdp=2, tp=1).resolve(8)
    with pytest.raises(ConfigError, match="does not divide the 8"):
        MeshSection(dp=-1, tp=3).resolve(8)
    with pytest.raises(ConfigError, match=r"mesh\.tp=0"):
        MeshSection(tp=0).resolve(8)


def test_batch_size_helpers():
    config = RewardConfig(
        per_device_train_batch_size=4,
        per_device_eval_batch_size=16,
        gradient_accumulation_steps=2,
        mesh={"dp": -1, "fsdp": 2, "tp": 1},
    )
    assert config.data_parallel_size(8) == 8  # dp 4 × fsdp 2
    assert config.micro_batch_size(8) == 32
    assert config.global_train_batch_size(8) == 64
    assert config.global_eval_batch_size(8) == 128
    with pytest.raises(ConfigError, match="does not divide the 1"):
        config.global_train_batch_size(1)  # fsdp=2 does not fit on one device
    assert config.num_training_steps(num_train_pairs=130, num_devices=8) == 3  # ceil(130 / 64)
    config.num_train_epochs = 2
    assert config.num_training_steps(130, 8) == 6
    config.max_training_steps = 5
    assert config.num_training_steps(130, 8) == 5


@pytest.mark.parametrize(
    ("kwargs", "num_devices", "pattern"),
    [
        ({"warmup_steps": 5, "warmup_ratio": 0.1}, 1, "both set; keep one"),
        ({"final_learning_rate": 1e-3, "learning_rate": 1e-4}, 1, "above optim.learning_rate"),
        ({"schedule": "constant", "final_learning_rate": 1e-6}, 1, "no effect with the constant"),
        ({"momentum": 0.9}, 1, "only used by sgd; set optim.name=sgd"),
        (
            {"offload_params": True, "dtype": "bfloat16"},
            1,
            "offload_params=true needs optim.offload_state=true and optim.name=adamw",
        ),
        (
            {"offload_params": True, "offload_state": True, "dtype": "float32"},
            1,
            "got model.dtype=float32, model.param_dtype=float32: set model.dtype=bfloat16",
        ),
        ({"per_device_train_batch_size": 0}, 1, "per_device_train_batch_size=0 must be at least 1"),
        ({"gradient_accumulation_steps": -1}, 1, "gradient_accumulation_steps=-1"),
        ({"learning_rate": 0.0}, 1, "learning_rate=0.0 must be a positive number"),
        ({"dropout_rate": 1.0}, 1, r"dropout_rate=1.0 must be in \[0, 1\)"),
        ({"max_grad_norm": 0.0}, 1, "or null for no clipping"),
        ({"center_rewards_coefficient": -0.1}, 1, "center_rewards_coefficient=-0.1"),
        ({"bucket_lengths": (64, 1024), "max_sequence_length": 512}, 1, "bucket_lengths has 1024"),
        (
            {"bucket_lengths": (8193,), "max_sequence_length": 512, "layout": "shared_prompt"},
            1,
            r"outside 1..2 x per_device_train_batch_size x max_sequence_length=8192",
        ),
        ({"mesh": {"dp": 2, "fsdp": 1, "tp": 1}}, 8, "= 2 but 8 devices"),
        ({"mesh": {"dp": -1, "tp": 3}}, 4, "does not divide the 4"),
        ({"save_steps": 0}, 1, "checkpoint.save_steps=0"),
        ({"report_to": ["wandb", "wandb"]}, 1, "repeats a target"),
    ],
)
def test_validate_says_what_to_change(kwargs, num_devices, pattern):
    config = RewardConfig(**kwargs)
    with pytest.raises(ConfigError, match=pattern):
        config.validate(num_devices)


def test_validate_lists_every_problem_at_once():
    config = RewardConfig(per_device_train_batch_size=0, warmup_steps=1, warmup_ratio=0.5)
    with pytest.raises(ConfigError) as error:
        config.validate()
    assert "per_device_train_batch_size=0" in str(error.value)
    assert "both set" in str(error.value)


def test_validate_checks_the_process_count():
    config = RewardConfig(mesh={"dp": 1, "fsdp": 1, "tp": 8})
    config.validate(8)  # one process: fine
    with pytest.raises(ConfigError, match="not a multiple of the 2 processes"):
        config.validate(8, num_processes=2)
    # Packed rows cannot be lined up across processes; accumulation is fine on one.
    packed = RewardConfig(layout="shared_prompt", gradient_accumulation_steps=2)
    packed.validate(8)
    with pytest.raises(ConfigError, match=r"data\.layout=shared_prompt needs one process"):
        packed.validate(8, num_processes=2)
    RewardConfig(layout="padded").validate(8, num_processes=2)


def test_values_assigned_later_are_converted_and_checked_at_once_and_validate_changes_nothing():
    config = RewardConfig()
    config.optim.learning_rate = "1e-4"  # assigned on the section: converted by its type now
    assert config.optim.learning_rate == 1e-4
    with pytest.raises(ConfigError, match=r"optim\.schedule must be one of"):
        config.optim.schedule = "exponential"
    assert config.optim.schedule == "linear"  # a refused value leaves the field as it was
    before = config.to_dict()
    assert config.validate() is config
    assert config.to_dict() == before


def test_shipped_configs_load_and_validate():
    default = RewardConfig.from_yaml(CONFIGS / "default.yaml").validate(1)
    # The benchmark recipe: batch 8, lr 2e-5, linear decay after 5 warmup steps, 64 tokens.
    assert default.global_train_batch_size(1) == 8
    assert (default.optim.learning_rate, default.optim.schedule) == (2e-5, "linear")
    assert default.optim.warmup_steps == 5
    assert default.data.max_sequence_length == 64
    assert (default.data.layout, default.data.bucket_lengths) == ("shared_prompt", (128, 192))
    # Compute dtype and remat are the backend's (float32 and none on the CPU, where the rest of
    # this recipe was tuned; tests/test_trainer.py checks what they become).
    assert (default.model.dtype, default.model.matmul_dtype) == ("auto", "bfloat16")
    assert default.model.remat_policy == "auto"
    assert default.eval.eval_at_start and default.eval.eval_steps == 40
    assert default.model.path is None
    tiny = RewardConfig.from_yaml(CONFIGS / "tiny.yaml").validate(8)
    assert tiny.train.max_training_steps == 4
    assert tiny.global_train_batch_size(1) == 4


def test_packed_rows_may_be_longer_than_max_sequence_length():
    """A shared_prompt row holds a prompt and two responses, a packed row several sequences, so
    their lengths may pass max_sequence_length (what the packer allows); padded rows may not."""
    RewardConfig(bucket_lengths=(128,), max_sequence_length=64, layout="shared_prompt").validate()
    RewardConfig(bucket_lengths=(192,), max_sequence_length=64, layout="shared_prompt").validate()
    RewardConfig(bucket_lengths=(1024,), max_sequence_length=64, layout="packed").validate()
    with pytest.raises(ConfigError, match="bucket_lengths has 128"):
        RewardConfig(bucket_lengths=(128,), max_sequence_length=64).validate()


def test_model_kernels_setting_is_checked_and_reaches_the_loaded_model(tmp_path):
    from data_fixtures import smollm2_tokenizer, tiny_llama
    from rewardax.models import AutoRewardModel

    assert RewardConfig().model.kernels == "auto"
    assert RewardConfig().with_overrides(["model.kernels=xla"]).model.kernels == "xla"
    with pytest.raises(ConfigError, match=r"model\.kernels"):
        RewardConfig().with_overrides(["model.kernels=fast"]).validate()
    tiny_llama(smollm2_tokenizer()).save_pretrained(tmp_path / "m")
    assert AutoRewardModel.from_pretrained(tmp_path / "m", kernels="pallas").kernels == "pallas"


def test_config_remat_policies_are_the_models():
    # config.py lists them as a Literal without importing the models (a light import); the
    # layers validate against REMAT_POLICIES: a policy added to one must be added to the other.
    from typing import get_args

    from rewardax.config import RematPolicy
    from rewardax.models.transformer import REMAT_POLICIES

    assert set(get_args(RematPolicy)) == {"auto", *REMAT_POLICIES}
