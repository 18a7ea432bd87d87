"""Config dataclasses: every rule (Megatron's text, then field, value, fix) and dotted overrides."""

from __future__ import annotations

import dataclasses
import re

import pytest

from annotate_offload.config import (
    Config,
    ModelConfig,
    OffloadPolicy,
    OptimizerConfig,
    TrainConfig,
    check_offload_num_layers,
    from_overrides,
)

ON = {"cpu_offloading": True, "num_layers": 4}


def test_defaults_are_valid_and_frozen():
    cfg = Config()
    assert cfg.model.cpu_offloading is False
    assert cfg.model.cpu_offloading_num_layers is None
    assert cfg.model.min_offload_numel == 256 * 1024
    assert cfg.model.offload_policy is OffloadPolicy.OPT_OUT
    assert cfg.optimizer.use_distributed_optimizer is True
    assert cfg.optimizer.optimizer_cpu_offload is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.cpu_offloading = True  # type: ignore[misc]


def test_keyword_only():
    with pytest.raises(TypeError):
        ModelConfig(True)  # type: ignore[misc]


# --------------------------------------------------------------- Megatron's activation rules


@pytest.mark.parametrize("n", [-1, 4, 7])
def test_num_layers_range(n):
    with pytest.raises(ValueError, match=r"CPU offloading can be done only for layers less than 4 "
                                         rf"\(model\.cpu_offloading_num_layers={n}\)\. Fix: .*<= 3"):
        ModelConfig(**ON, cpu_offloading_num_layers=n)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_num_layers_range_ok(n):
    assert ModelConfig(**ON, cpu_offloading_num_layers=n).cpu_offloading_num_layers == n


def test_num_layers_range_only_checked_when_offloading_like_megatron():
    assert ModelConfig(num_layers=4, cpu_offloading_num_layers=9).cpu_offloading is False


def test_negative_num_layers_rejected_even_without_model_count():
    with pytest.raises(ValueError, match=r"only for layers less than num_layers .*=-2"):
        ModelConfig(cpu_offloading=True, cpu_offloading_num_layers=-2)


def test_check_offload_num_layers_helper():
    check_offload_num_layers(0, 1)
    with pytest.raises(ValueError, match=r"less than 8 \(model\.cpu_offloading_num_layers=8\)"):
        check_offload_num_layers(8, 8)


def test_pipeline_parallel():
    with pytest.raises(ValueError, match=r"^Currently there is no support for Pipeline parallelism with CPU "
                                         r"offloading \(model\.pipeline_model_parallel_size=2\)\. Fix: set "
                                         r"model\.pipeline_model_parallel_size=1"):
        ModelConfig(**ON, pipeline_model_parallel_size=2)
    assert ModelConfig(pipeline_model_parallel_size=2).pipeline_model_parallel_size == 2


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute(granularity):
    with pytest.raises(ValueError, match=r"^CPU offloading does not work when activation recomputation is "
                                         rf"enabled \(model\.recompute_granularity='{granularity}'\)\. Fix: "):
        ModelConfig(**ON, recompute_granularity=granularity)


def test_recompute_choice():
    with pytest.raises(ValueError, match=r'must be "full" or "selective".*recompute_granularity=\'block\''):
        ModelConfig(recompute_granularity="block")


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_cuda_graphs(impl):
    with pytest.raises(ValueError, match=rf"^CUDA graphs not supported with CPU offloading\. "
                                         rf"\(model\.cuda_graph_impl='{impl}'\)\. Fix: set model\.cuda_graph_impl='none'"):
        ModelConfig(**ON, cuda_graph_impl=impl)


def test_cuda_graph_choice():
    with pytest.raises(ValueError, match=r"Invalid cuda graph implementation: full_iteration .*use one of"):
        ModelConfig(cuda_graph_impl="full_iteration")


def test_fine_grained():
    with pytest.raises(ValueError, match=r"^fine_grained_activation_offloading cannot be enabled with "
                                         r"cpu_offloading\. \(model\.fine_grained_activation_offloading=True\)"):
        ModelConfig(**ON, fine_grained_activation_offloading=True)
    assert ModelConfig(fine_grained_activation_offloading=True).fine_grained_activation_offloading


def test_nothing_to_offload():
    with pytest.raises(ValueError, match=r"not mentioned what to offload .*cpu_offloading_activations=False"):
        ModelConfig(**ON, cpu_offloading_activations=False)
    # weights only is accepted here; offload_transform warns that weights are not offloaded.
    assert ModelConfig(**ON, cpu_offloading_activations=False, cpu_offloading_weights=True)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"num_layers": 0}, r"model\.num_layers=0"),
        ({"pipeline_model_parallel_size": 0}, r"model\.pipeline_model_parallel_size=0"),
        ({"min_offload_numel": -1}, r"model\.min_offload_numel=-1"),
        ({"release_lag": -1}, r"model\.release_lag=-1"),
        ({"prefetch_layers": 0}, r"model\.prefetch_layers=0"),
        ({"seq_length": 0}, r"model\.seq_length=0"),
        ({"offload_policy": "everything"}, r"'everything' is not a valid OffloadPolicy|model\.offload_policy"),
    ],
)
def test_model_ranges(kwargs, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        ModelConfig(**kwargs)


def test_policy_accepts_string():
    assert ModelConfig(offload_policy="opt_in").offload_policy is OffloadPolicy.OPT_IN


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"cpu_offloading": 1}, r"model\.cpu_offloading must be bool, got 1 \(int\)"),
        ({"num_layers": "4"}, r"model\.num_layers must be int \| None, got '4' \(str\)"),
        ({"num_layers": 4.0}, r"model\.num_layers must be int \| None"),
        ({"cpu_offloading_num_layers": True}, r"model\.cpu_offloading_num_layers must be int \| None"),
    ],
)
def test_model_types(kwargs, pattern):
    with pytest.raises(TypeError, match=pattern):
        ModelConfig(**kwargs)


# --------------------------------------------------------------- optimizer and train rules


def test_optimizer_offload_needs_distributed_optimizer():
    with pytest.raises(ValueError, match=r"requires the distributed optimizer "
                                         r"\(optimizer\.use_distributed_optimizer=False\)\. Fix: set "
                                         r"optimizer\.use_distributed_optimizer=True"):
        OptimizerConfig(optimizer_cpu_offload=True, use_distributed_optimizer=False)
    assert not OptimizerConfig(use_distributed_optimizer=False).use_distributed_optimizer


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_fraction_range(fraction):
    with pytest.raises(ValueError, match=rf"optimizer_offload_fraction must be in \[0, 1\] "
                                         rf"\(optimizer\.optimizer_offload_fraction={fraction}\)\. Fix: "):
        OptimizerConfig(optimizer_offload_fraction=fraction)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1, 1.0])
def test_fraction_ok(fraction):
    assert OptimizerConfig(optimizer_offload_fraction=fraction).optimizer_offload_fraction == fraction


def test_fraction_zero_with_offload_warns():
    with pytest.warns(UserWarning, match="offloads nothing"):
        OptimizerConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=0.0)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"optimizer": "sgd"}, r"optimizer\.optimizer='sgd'.*adam"),
        ({"lr": 0.0}, r"optimizer\.lr=0\.0"),
        ({"weight_decay": -1.0}, r"optimizer\.weight_decay=-1\.0"),
        ({"adam_beta1": 1.0}, r"optimizer\.adam_beta1=1\.0"),
        ({"adam_beta2": -0.5}, r"optimizer\.adam_beta2=-0\.5"),
        ({"adam_eps": 0.0}, r"optimizer\.adam_eps=0\.0"),
        ({"clip_grad": -1.0}, r"optimizer\.clip_grad=-1\.0"),
    ],
)
def test_optimizer_ranges(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        OptimizerConfig(**kwargs)


def test_optimizer_types():
    with pytest.raises(TypeError, match=r"optimizer\.optimizer_offload_fraction must be float, got '0\.5'"):
        OptimizerConfig(optimizer_offload_fraction="0.5")  # type: ignore[arg-type]


def test_train_rules():
    for name in ("train_iters", "micro_batch_size"):
        with pytest.raises(ValueError, match=rf"train\.{name}=0"):
            TrainConfig(**{name: 0})
    with pytest.raises(ValueError, match=r"train\.seed=-1"):
        TrainConfig(seed=-1)


def test_config_section_types():
    with pytest.raises(TypeError, match="Config.model must be a ModelConfig"):
        Config(model=OptimizerConfig())  # type: ignore[arg-type]


# --------------------------------------------------------------- overrides


def test_from_overrides_parses_types():
    cfg = from_overrides([
        "model.cpu_offloading=True",
        "model.num_layers=4",
        "model.cpu_offloading_num_layers=3",
        "model.offload_policy=opt_in",
        "model.prefetch_layers=null",
        "model.recompute_granularity=None",
        "optimizer.optimizer_cpu_offload=true",
        "optimizer.optimizer_offload_fraction=0.5",
        "optimizer.lr=1e-3",
        "optimizer.overlap_cpu_optimizer_d2h_h2d=1",
        "train.train_iters=1e3",
        "train.micro_batch_size=4",
    ])
    assert cfg.model.cpu_offloading is True and cfg.model.cpu_offloading_num_layers == 3
    assert cfg.model.offload_policy is OffloadPolicy.OPT_IN and cfg.model.prefetch_layers is None
    assert cfg.optimizer.optimizer_offload_fraction == 0.5 and cfg.optimizer.lr == 1e-3
    assert cfg.optimizer.overlap_cpu_optimizer_d2h_h2d is True
    assert cfg.train.train_iters == 1000 and cfg.train.micro_batch_size == 4


def test_from_overrides_order_free_and_base_unchanged():
    base = Config(model=ModelConfig(num_layers=4))
    # cpu_offloading_num_layers before cpu_offloading; validated once on the result.
    cfg = from_overrides(["model.cpu_offloading_num_layers=2", "model.cpu_offloading=True"], base=base)
    assert cfg.model.cpu_offloading_num_layers == 2 and base.model.cpu_offloading is False
    # a later duplicate wins
    cfg = from_overrides(["train.seed=1", "train.seed=2"])
    assert cfg.train.seed == 2


def test_from_overrides_unknown_key_suggests_closest():
    with pytest.raises(ValueError, match=r"unknown key 'model\.cpu_offload'; did you mean 'model\.cpu_offloading'\?"):
        from_overrides(["model.cpu_offload=True"])
    with pytest.raises(ValueError, match=r"unknown key 'optimizer\.offload_fraction'; did you mean "
                                         r"'optimizer\.optimizer_offload_fraction'\?"):
        from_overrides(["optimizer.offload_fraction=0.5"])
    with pytest.raises(ValueError, match=r"unknown section 'trian'; did you mean 'train'\?"):
        from_overrides(["trian.train_iters=3"])
    with pytest.raises(ValueError, match=r"unknown key 'model\.zzzzzz'; valid model keys: .*cpu_offloading"):
        from_overrides(["model.zzzzzz=1"])


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("model.cpu_offloading=maybe", r"expected a bool"),
        ("model.num_layers=four", r"expected int \| None"),
        ("train.train_iters=2.5", r"expected an int"),
        ("optimizer.lr=fast", r"expected a float"),
        ("model.offload_policy=all", r"expected one of \['opt_out', 'opt_in'\]"),
        ("model.cpu_offloading", r"not of the form section\.field=value"),
        ("cpu_offloading=True", r"not of the form section\.field=value"),
    ],
)
def test_from_overrides_bad_values(override, pattern):
    with pytest.raises(ValueError, match=pattern):
        from_overrides([override])


@pytest.mark.parametrize(
    "override, example",
    [
        ("model.cpu_offloading_num_layers=abc",
         "e.g. model.cpu_offloading_num_layers=2 or model.cpu_offloading_num_layers=None."),
        ("train.train_iters=2.5", "e.g. train.train_iters=10."),  # the current value of the base
        ("model.cpu_offloading=maybe", "e.g. model.cpu_offloading=True or model.cpu_offloading=False."),
        ("optimizer.lr=fast", "e.g. optimizer.lr="),
    ],
)
def test_from_overrides_type_errors_show_a_valid_example(override, example):
    with pytest.raises(ValueError) as info:
        from_overrides([override], base=Config(train=TrainConfig(train_iters=10)))
    assert str(info.value).endswith(example) or example.endswith("=") and example in str(info.value)
    value = str(info.value).rsplit("e.g. ", 1)[1].split(" or ")[0].rstrip(".")
    from_overrides([value])  # the example itself is accepted


def test_from_overrides_runs_the_rules():
    with pytest.raises(ValueError, match=re.escape("Currently there is no support for Pipeline parallelism")):
        from_overrides(["model.cpu_offloading=True", "model.pipeline_model_parallel_size=2"])


def test_from_overrides_rejects_single_string():
    with pytest.raises(TypeError, match="wrap it in a list"):
        from_overrides("model.cpu_offloading=True")  # type: ignore[arg-type]


def test_every_field_round_trips_through_an_override():
    cfg = from_overrides(["model.offload_policy=opt_in", "model.num_layers=3"])
    flat = [f"{s}.{f.name}={getattr(getattr(cfg, s), f.name)}" for s in ("model", "optimizer", "train")
            for f in dataclasses.fields(getattr(cfg, s))]
    flat = [v.replace("OffloadPolicy.OPT_IN", "opt_in") for v in flat]
    assert from_overrides(flat) == cfg


def test_from_overrides_key_in_wrong_section_points_to_the_right_one():
    with pytest.raises(ValueError, match=r"did you mean 'optimizer\.optimizer_offload_fraction'\?"):
        from_overrides(["model.optimizer_offload_fraction=0.5"])


def test_a_budget_override_replaces_the_bases_fixed_plan_unless_it_sets_one_too():
    base = Config(model=ModelConfig(**ON, cpu_offloading_num_layers=3, recompute=True))
    cfg = from_overrides(["model.memory_budget=20GiB"], base=base)
    assert (cfg.model.memory_budget, cfg.model.cpu_offloading_num_layers, cfg.model.recompute) == ("20GiB", None, False)
    with pytest.raises(ValueError, match=r"memory_budget lets the planner choose the layers"):
        from_overrides(["model.memory_budget=20GiB", "model.cpu_offloading_num_layers=2"], base=base)
