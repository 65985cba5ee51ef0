"""Job config: defaults equal the shipped YAML, overrides, and errors that name the key and the range."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from staleflow.runtime.run.run_spec import RunSpec
from staleflow.runtime.settings.config import (
    ConfigError,
    JobConfig,
    dump_config,
    load_config,
)
from staleflow.runtime.settings.policies import ALIASES, POLICIES, find_policy


def test_default_yaml_is_the_built_in_job() -> None:
    config = load_config()
    # the defaults, and the one knob tuned for vLLM-CPU (the others keep the system's values)
    assert config == JobConfig(coordinator={"mu": 0.02})
    assert config.coordinator.policy_knobs() == {"mu": 0.02}
    assert config.system == "staleflow"
    assert (config.protocol.eta, config.protocol.batch_groups, config.rollout.group_size) == (2, 16, 8)
    assert (config.train.lr, config.train.betas, config.rollout.max_new_tokens) == (3e-4, (0.9, 0.98), 72)
    assert config.batch_trajectories == 128


def test_overrides_are_parsed_as_yaml_on_dotted_keys() -> None:
    config = load_config(
        overrides=[
            "protocol.eta=4",
            "train.lr=1e-4",
            "train.betas=[0.8, 0.9]",
            "metrics.tensorboard=false",
            "task.prompt_file=data/p.jsonl",
            "task.reward=exact_match",
        ]
    )
    assert config.protocol.eta == 4
    assert config.train.lr == pytest.approx(1e-4)
    assert config.train.betas == (0.8, 0.9)
    assert config.metrics.tensorboard is False
    assert config.task.prompt_file == "data/p.jsonl"


def test_eta_defaults_follow_the_system() -> None:
    assert load_config(overrides=["system=sync"]).protocol.eta == 0
    assert load_config(overrides=["system=one-step-off"]).protocol.eta == 1
    assert load_config(overrides=["system=inflight-cap"]).protocol.eta == 2
    assert load_config(overrides=["system=staleflow", "protocol.eta=8"]).protocol.eta == 8


def test_dump_round_trips(tmp_path: Path) -> None:
    config = load_config(overrides=["protocol.eta=3", "seed=7", "train.correction=tis"])
    file = tmp_path / "job.yaml"
    file.write_text(dump_config(config))
    assert load_config(file) == config


@pytest.mark.parametrize(
    "override, expected",
    [
        ("protocol.eta=-1", "protocol.eta: Input should be greater than or equal to 0 (got -1); allowed: int >= 0 and <= 1024"),
        ("train.lr=2", "train.lr: Input should be less than or equal to 1 (got 2); allowed: float > 0 and <= 1"),
        ("rollout.group_size=x", "rollout.group_size: Input should be a valid integer"),
        ("system=async", "system: Input should be"),
        ("train.correction=vtrace", "allowed: one of none, decoupled_ppo, tis"),
        ("train.max_time_s=0", "train.max_time_s: Input should be greater than 0 (got 0); allowed: null or float > 0"),
        ("train.lrr=1", "train.lrr: unknown key; allowed keys here: backend, steps"),
        ("train.betas=[1.5, 0.9]", "train.betas[0] = 1.5 is out of range; allowed: 0 <= beta < 1"),
    ],
)
def test_invalid_values_name_the_key_and_the_allowed_range(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert expected in str(err.value)
    assert "with overrides" in str(err.value)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["system=sync", "protocol.eta=2"], "system=sync trains on-policy; it needs protocol.eta=0 (got 2)"),
        (["system=one-step-off", "protocol.eta=3"], "system=one-step-off needs protocol.eta=1 (got 3)"),
        (["train.minibatches=3"], "train.minibatches=3 must divide protocol.batch_groups=16"),
        (["rollout.group_size=1"], "group advantages need at least 2 samples per group"),
        (["rollout.max_new_tokens=250"], "task.max_prompt_tokens (32) + rollout.max_new_tokens (250) exceeds rollout.max_model_len (256)"),
        (["task.max_count=100"], "task.max_count=100 needs rollout.max_new_tokens >= 101"),
        (["task.reward=exact_match"], "the built-in task is scored by task.reward=repeat_letter"),
        (["task.eval_prompts=0"], "task.eval_every > 0 needs task.eval_prompts > 0"),
    ],
)
def test_contradictory_settings_are_refused(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match="invalid config") as err:
        load_config(overrides=overrides)
    assert expected in str(err.value)


def test_bad_files_and_overrides(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections, got list"):
        load_config(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(overrides=["protocol.eta"])
    with pytest.raises(ConfigError, match="protocol.eta is not a section"):
        load_config(overrides=["protocol.eta.x=1"])
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml") == JobConfig()


@pytest.mark.parametrize("name", [*POLICIES, *ALIASES])
def test_the_table_of_systems_decides_what_a_job_accepts(name: str) -> None:
    """Which systems a job runs, their default eta and their refusals all come from POLICIES."""
    policy = find_policy(name)
    assert policy is not None
    if not policy.trainable:  # no protocol to trace (areal, verl-async) or colocated (verl-sync)
        with pytest.raises(ConfigError, match=f"system: Input should be a system a training job runs \\(got '{name}'\\)"):
            load_config(overrides=[f"system={name}"])
        return
    config = load_config(overrides=[f"system={name}"])
    assert config.protocol.eta == policy.default_eta == (2 if policy.fixed_eta is None else policy.fixed_eta)
    assert policy.protocol_eta(config.protocol.eta) == config.protocol.eta  # the default is what the protocol runs with
    assert RunSpec.from_job(config).policy.name == policy.name
    other = policy.default_eta + 1
    if policy.fixed_eta is None:
        assert load_config(overrides=[f"system={name}", f"protocol.eta={other}"]).protocol.eta == other
    else:
        with pytest.raises(ConfigError, match=f"system={name} .*needs protocol.eta={policy.fixed_eta} \\(got {other}\\)"):
            load_config(overrides=[f"system={name}", f"protocol.eta={other}"])
    if policy.takes_redundancy:
        assert load_config(overrides=[f"system={name}", "protocol.redundancy=2"]).protocol.redundancy == 2
    else:
        with pytest.raises(ConfigError, match=f"system={name} has no redundancy; protocol.redundancy must be 0 \\(got 2\\)"):
            load_config(overrides=[f"system={name}", "protocol.redundancy=2"])


def test_a_new_entry_in_the_table_changes_what_a_job_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="system: Input should be"):
        load_config(overrides=["system=two-step-off"])
    monkeypatch.setitem(POLICIES, "two-step-off", replace(POLICIES["one-step-off"], name="two-step-off", fixed_eta=2))
    assert load_config(overrides=["system=two-step-off"]).protocol.eta == 2
    with pytest.raises(ConfigError, match=r"system=two-step-off needs protocol.eta=2 \(got 3\)"):
        load_config(overrides=["system=two-step-off", "protocol.eta=3"])
    # a changed entry changes the rules: one-step-off made unbounded is no longer a training system
    monkeypatch.setitem(POLICIES, "one-step-off", replace(POLICIES["one-step-off"], consumption="finish_order"))
    with pytest.raises(ConfigError, match="allowed: one of staleflow, "):
        load_config(overrides=["system=one-step-off"])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("seed=true", "seed: Input should be a valid integer (got True)"),
        ("seed='3'", "seed: Input should be a valid integer (got '3')"),
        ("train.lr=true", "train.lr: Input should be a valid number (got True)"),
        ("metrics.tensorboard='no'", "metrics.tensorboard: Input should be a valid boolean (got 'no')"),
    ],
)
def test_types_are_strict(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert expected in str(err.value)


def test_exponent_floats_read_as_numbers(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text("train:\n  lr: 3e-4\n")
    assert load_config(tmp_path / "job.yaml").train.lr == pytest.approx(3e-4)
    assert load_config(overrides=["warmup.lr=1E-3"]).warmup.lr == pytest.approx(1e-3)
