"""torch-style parameter groups (param_groups.py): ``check_param_groups`` checks them before
anything is sharded, keeping a user's own keys as torch does (naming one that looks like a
misspelled setting), refusing torch options outcore's kernels do not
run, tensors that are not the model's parameters, a parameter in two groups and a trainable
parameter in none, and returns each group's own dict with its parameters;
``from_torch_optimizer`` ([Note: adopting a torch optimizer]) takes the type and the
hyper-parameters from a torch optimizer's ``defaults`` and its ``param_groups`` dicts
themselves, and refuses an optimizer it cannot run, by name."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from outcore.errors import ConfigError
from outcore.optim.param_groups import HP_KEYS, check_param_groups, from_torch_optimizer


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _split(model: nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0,
             "lr": 1e-4}]


# -- check_param_groups -----------------------------------------------------------------------
def test_none_means_no_groups() -> None:
    assert check_param_groups(_model(), None) is None


def test_groups_come_back_as_the_same_dicts_with_their_parameters() -> None:
    model = _model()
    groups = _split(model)
    out = check_param_groups(model, groups)
    assert out is not None and len(out) == 2
    assert out[0][0] is groups[0] and out[1][0] is groups[1]
    assert [p.shape for p in out[0][1]] == [(3, 4), (2, 3)]
    assert [p.shape for p in out[1][1]] == [(3,), (2,)]
    assert out[1][0]["lr"] == 1e-4  # overrides stay as given


def test_a_generator_of_params_is_listed() -> None:
    model = _model()
    out = check_param_groups(model, [{"params": (p for p in model.parameters())}])
    assert out is not None and len(out[0][1]) == 4


@pytest.mark.parametrize("form", ["parameters", "list", "named", "one tensor per group"])
def test_torch_optims_other_forms_are_taken(form: str) -> None:
    """``param_groups=model.parameters()`` (DeepSpeed's ``model_parameters=`` habit) failed
    in torch's words: "Tensor.__contains__ only supports Tensor or scalar"."""
    model = _model()
    given = {"parameters": model.parameters(), "list": list(model.parameters()),
             "named": model.named_parameters(),
             "one tensor per group": [{"params": p} for p in model.parameters()]}[form]
    out = check_param_groups(model, given)
    assert out is not None
    assert [p for _, ps in out for p in ps] == list(model.parameters())


@pytest.mark.parametrize(("given", "said"), [
    ([], "param_groups is empty"), ("not groups", "holds a str"),
    ([{"params": []}, nn.Linear(2, 2).weight], "holds dicts and tensors together"),
    (nn.Linear(2, 2).weight, "not a Parameter"), ({"params": []}, "not a dict")])
def test_what_torch_optim_would_refuse_is_named(given: object, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        check_param_groups(_model(), given)  # type: ignore[arg-type]


def test_every_hyper_parameter_key_and_torch_bookkeeping_key_is_accepted() -> None:
    model = _model()
    spec = {"params": list(model.parameters()), "lr": 1.0, "betas": (0.9, 0.99), "eps": 1e-8,
            "weight_decay": 0.0, "momentum": 0.0, "nesterov": False, "foreach": True,
            "fused": None, "capturable": False, "maximize": False, "amsgrad": False,
            "initial_lr": 3e-4}
    assert set(HP_KEYS) <= set(spec)
    assert check_param_groups(model, [spec]) is not None


def test_a_users_own_keys_are_kept_and_a_misspelled_setting_is_named() -> None:
    """torch's optimizers keep any key in a group (a name, a learning-rate scale a scheduler
    reads); a key a letter from a setting is most likely that setting misspelled."""
    model = _model()
    own = {"params": list(model[1].parameters()), "name": "head", "lr_scale": 0.5}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = check_param_groups(model, [{"params": [model[0].weight, model[0].bias]}, own])
    assert out is not None and out[1][0] is own and own["lr_scale"] == 0.5
    with pytest.warns(UserWarning, match=r"param_groups\[0\]: key 'weight_decya' .*"
                                         r"did you mean 'weight_decay'"):
        check_param_groups(model, [{"params": list(model.parameters()), "weight_decya": 0.1}])


@pytest.mark.parametrize(("key", "value"), [("amsgrad", True), ("maximize", True),
                                            ("capturable", True), ("dampening", 0.5)])
def test_a_torch_option_outcore_does_not_run_is_refused(key: str, value: object) -> None:
    model = _model()
    with pytest.raises(ConfigError, match=rf"param_groups\[0\]: {key}=.* is not supported"):
        check_param_groups(model, [{"params": list(model.parameters()), key: value}])


def test_a_parameter_in_two_groups_is_refused_by_name() -> None:
    model = _model()
    groups = [{"params": list(model.parameters())}, {"params": [model[1].bias]}]
    with pytest.raises(ConfigError, match=r"parameter 1\.bias appears in two param groups"):
        check_param_groups(model, groups)


def test_a_tensor_not_of_the_model_is_refused() -> None:
    model = _model()
    stranger = nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match=r"param_groups\[0\] holds a tensor that is not a "
                                          "parameter of this model"):
        check_param_groups(model, [{"params": [*model.parameters(), stranger]}])


def test_a_trainable_parameter_in_no_group_is_refused_by_name() -> None:
    model = _model()
    with pytest.raises(ConfigError, match=r"in no param group: \['1\.weight', '1\.bias'\]"):
        check_param_groups(model, [{"params": list(model[0].parameters())}])


def test_a_frozen_parameter_may_be_left_out() -> None:
    model = _model()
    model[1].requires_grad_(False)
    out = check_param_groups(model, [{"params": list(model[0].parameters())}])
    assert out is not None and len(out[0][1]) == 2


# -- from_torch_optimizer ---------------------------------------------------------------------
def test_adamw_keys_come_from_its_defaults_and_its_groups_are_kept() -> None:
    model = _model()
    opt = torch.optim.AdamW(_split(model), lr=2e-3, betas=(0.8, 0.9), eps=1e-7,
                            weight_decay=0.05)
    keys, groups = from_torch_optimizer(opt)
    assert keys == {"type": "adamw", "lr": 2e-3, "betas": [0.8, 0.9], "eps": 1e-7,
                    "weight_decay": 0.05}
    assert groups is opt.param_groups  # a scheduler's edits reach the engine's groups
    assert groups[1]["lr"] == 1e-4 and groups[0]["lr"] == 2e-3  # torch filled the defaults
    assert check_param_groups(model, groups) is not None  # torch's own keys pass the check


def test_sgd_keys() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, nesterov=True)
    keys, _ = from_torch_optimizer(opt)
    assert keys == {"type": "sgd", "lr": 0.5, "momentum": 0.9, "nesterov": True,
                    "weight_decay": 0}


def test_adam_is_adam_and_adam_with_decoupled_decay_is_adamw() -> None:
    model = _model()
    keys, _ = from_torch_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    assert keys["type"] == "adam" and keys["betas"] == [0.9, 0.999]
    try:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, decoupled_weight_decay=True)
    except TypeError:
        pytest.skip("this torch's Adam has no decoupled_weight_decay")
    assert from_torch_optimizer(opt)[0]["type"] == "adamw"


def test_an_optimizer_outcore_cannot_run_is_refused_by_name() -> None:
    model = _model()
    with pytest.raises(ConfigError, match=r"optimizer torch\.optim\.rmsprop\.RMSprop cannot "
                                          "run over outcore's shards"):
        from_torch_optimizer(torch.optim.RMSprop(model.parameters()))


def test_a_subclass_under_another_name_is_refused() -> None:
    class MyAdamW(torch.optim.AdamW):
        pass

    with pytest.raises(ConfigError, match="MyAdamW cannot run"):
        from_torch_optimizer(MyAdamW(_model().parameters()))


@pytest.mark.parametrize(("kind", "momentum", "spec", "said"), [
    ("sgd", 0.0, {"momentum": 0.9}, "momentum=0.9, but the run keeps no momentum buffers"),
    ("adam", 0.0, {"decoupled_weight_decay": True, "weight_decay": 0.1},
     "set optimizer.type to adamw"),
    ("adamw", 0.0, {"decoupled_weight_decay": False, "weight_decay": 0.1},
     "set optimizer.type to adam"),
])
def test_group_keys_the_runs_optimizer_does_not_do_are_refused(kind: str, momentum: float,
                                                               spec: dict, said: str) -> None:
    """A group's SGD momentum over a config without it trained as plain SGD (the buffers are
    planned from the config), and a group's decoupled_weight_decay under config Adam was
    dropped: 1e-2 and 9e-2 off torch in five steps, silently."""
    from types import SimpleNamespace

    model = _model()
    optimizer = SimpleNamespace(type=kind, momentum=momentum)
    with pytest.raises(ConfigError, match=said):
        check_param_groups(model, [{"params": list(model.parameters()), **spec}], optimizer)
    fits = {"momentum": 0.0} if kind == "sgd" else {"decoupled_weight_decay": kind == "adamw"}
    assert check_param_groups(model, [{"params": list(model.parameters()), **fits}], optimizer)
    if kind != "sgd":  # with no weight decay Adam and AdamW agree: torch Adam's groups pass
        no_decay = {**spec, "weight_decay": 0.0}
        assert check_param_groups(model, [{"params": list(model.parameters()), **no_decay}],
                                  optimizer)
    if kind == "sgd":  # with momentum in the config, a group's own momentum is taken
        optimizer.momentum = 0.5
        assert check_param_groups(model, [{"params": list(model.parameters()), **spec}],
                                  optimizer)
