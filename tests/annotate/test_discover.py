"""@offload_layer marks and layer discovery."""

from __future__ import annotations

import pytest
import torch.nn as nn

from annotate_offload.annotate import offload_layer
from annotate_offload.annotate._decorators import layer_mark
from annotate_offload.annotate._discover import find_layers

from ._models import MLPBlock, Stack, gpt


def test_class_mark_applies_to_every_instance_and_subclasses():
    @offload_layer
    class Block(nn.Module):
        pass

    class Sub(Block):
        pass

    assert layer_mark(Block()).offload and layer_mark(Sub()).offload
    assert layer_mark(nn.Linear(2, 2)) is None


def test_instance_mark_overrides_class_mark():
    @offload_layer
    class Block(nn.Module):
        pass

    a, b = Block(), Block()
    assert offload_layer(offload=False)(b) is b
    assert layer_mark(a).offload and not layer_mark(b).offload


def test_offload_false_decorator_keeps_layer_declared():
    @offload_layer(offload=False)
    class Head(nn.Module):
        pass

    assert layer_mark(Head()).offload is False


def test_mark_rejects_non_modules():
    with pytest.raises(TypeError, match="expected an nn.Module subclass or instance"):
        offload_layer(lambda x: x)
    with pytest.raises(TypeError, match="offload must be a bool"):
        offload_layer(offload="no")


def test_marks_do_not_change_state_dict():
    m = Stack()
    keys = list(m.state_dict())
    offload_layer(m.layers[0])
    assert list(m.state_dict()) == keys


def test_discovers_modulelist_blocks():
    refs, how = find_layers(Stack(n=3))
    assert [r.fqn for r in refs] == ["layers.0", "layers.1", "layers.2"]
    assert all(r.offload for r in refs)
    assert "discovered layers: 3 x MLPBlock" in how


def test_discovers_sequential_blocks_but_not_lists_of_lists():
    refs, how = find_layers(nn.ModuleList([nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(3)]))
    assert [r.fqn for r in refs] == ["0", "1", "2"] and how == "discovered <root>: 3 x Sequential"
    stages = nn.ModuleList([nn.ModuleList([MLPBlock(16) for _ in range(k)]) for k in (2, 3)])  # no forward of its own
    refs, how = find_layers(nn.Sequential(stages))
    assert [r.fqn for r in refs] == ["0.1.0", "0.1.1", "0.1.2"], how


def test_discovers_blocks_of_lazy_modules_before_they_are_materialised():
    refs, how = find_layers(nn.Sequential(nn.Linear(4, 4), nn.Sequential(*[nn.LazyLinear(8) for _ in range(3)])))
    assert [r.fqn for r in refs] == ["1.0", "1.1", "1.2"], how  # a parameter of unknown size counts as none


@pytest.mark.parametrize("n", [1, 3])
def test_builtin_models_declare_their_layers(n):
    """Discovery needs repeated blocks; GPTBlock and LlamaDecoderLayer are declared with
    @offload_layer, so a one-layer built-in model has its layer too."""
    from annotate_offload.models.llama import Llama, LlamaConfig

    refs, how = find_layers(gpt(n=n))
    assert [r.fqn for r in refs] == [f"layers.{i}" for i in range(n)] and how == "@offload_layer marks"
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=n, num_attention_heads=4,
                      num_key_value_heads=2)
    refs, how = find_layers(Llama(cfg, seed=0))
    assert len(refs) == n and how == "@offload_layer marks"


def test_discovery_prefers_the_largest_container_and_skips_nested():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])  # small, same class
            self.body = nn.Sequential(*[MLPBlock(16) for _ in range(2)])

    refs, _ = find_layers(Model())
    assert [r.fqn for r in refs] == ["body.0", "body.1"]


def test_discovery_names_the_other_containers_of_its_block_class():
    from annotate_offload import offload_transform

    class EncoderDecoder(nn.Module):  # which stack runs first only a forward shows: one is taken, the other named
        def __init__(self):
            super().__init__()
            self.enc = nn.ModuleList([MLPBlock(16) for _ in range(2)])
            self.heads = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])  # another class
            self.dec = nn.ModuleList([MLPBlock(16) for _ in range(3)])

    refs, how = find_layers(EncoderDecoder())
    assert [r.fqn for r in refs] == ["dec.0", "dec.1", "dec.2"]
    assert how == "discovered dec: 3 x MLPBlock (also enc: layer_types=MLPBlock takes them too)"
    with pytest.raises(ValueError, match=r"num_layers=4.*Layers: discovered dec.*also enc: layer_types=MLPBlock"):
        offload_transform(EncoderDecoder(), num_layers=4)


def test_marks_take_precedence_over_discovery_and_outermost_wins():
    m = Stack(n=3)
    offload_layer(m.layers[1])
    offload_layer(m.layers[1].fc1)  # inside a layer: part of it
    offload_layer(offload=False)(m.out)
    refs, how = find_layers(m)
    assert [(r.fqn, r.offload) for r in refs] == [("layers.1", True), ("out", False)]
    assert how == "@offload_layer marks"


def test_layer_types_and_filter_fn_override():
    m = Stack(n=2)
    refs, _ = find_layers(m, layer_types=nn.Linear)
    assert [r.fqn for r in refs] == ["inp", "layers.0.fc1", "layers.0.fc2", "layers.1.fc1", "layers.1.fc2", "out"]
    refs, _ = find_layers(m, filter_fn=lambda mod, fqn: fqn in ("layers.1", "layers.0"))
    assert [r.fqn for r in refs] == ["layers.0", "layers.1"]


def test_selection_errors():
    m = Stack(n=2)
    with pytest.raises(ValueError, match="pass layer_types= or filter_fn=, not both"):
        find_layers(m, layer_types=MLPBlock, filter_fn=lambda mod, fqn: True)
    with pytest.raises(TypeError, match="layer_types must be nn.Module subclasses"):
        find_layers(m, layer_types=(int,))
    with pytest.raises(TypeError, match="filter_fn must be callable"):
        find_layers(m, filter_fn=3)
    # a one-argument lambda: the message says how filter_fn is called
    with pytest.raises(TypeError, match=r"filter_fn is called as filter_fn\(module, fqn\) -> bool, but .* takes \(mod\)"):
        find_layers(m, filter_fn=lambda mod: True)
    refs, _ = find_layers(m, filter_fn=lambda *a: a[1] == "layers.0")  # *args is fine
    assert [r.fqn for r in refs] == ["layers.0"]
    with pytest.raises(ValueError, match=r"found no layers in Linear \(looked for @offload_layer marks, then an "
                                         r"nn.ModuleList/nn.Sequential of at least two blocks of one class\); mark"):
        find_layers(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"found no layers in Stack \(looked for layer_types=\(Conv2d\)\)"):
        find_layers(m, layer_types=nn.Conv2d)
