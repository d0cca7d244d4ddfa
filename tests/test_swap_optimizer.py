"""An optimiser and swap_attention: what one built before the swap holds (the carried-over weights,
the same Parameter objects, but not the new Φp), the one warning that says so,
posattn.parameters_added_by_swap, and examples/swap_finetune.py."""
import copy
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import posattn
from conftest import REPO
from posattn.swap import AddedParametersWarning, swap_attention

timm = pytest.importorskip('timm')

DEPTH = 2


def small_vit(**kwargs):
    return timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                             depth=DEPTH, num_heads=2, num_classes=5, global_pool='avg', **kwargs)


def swapped_quietly(model, phi='peripheral', **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', AddedParametersWarning)
        return swap_attention(model, phi=phi, **kwargs)


def phi_parameter_names(model):
    """The oracle: the parameters under a swapped layer's ``phi`` (``blocks.0.attn.phi.*``), by name."""
    return {name for name, _ in model.named_parameters() if '.attn.phi.' in name}


def training_step(model, optimizer):
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    optimizer.zero_grad()
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()


def test_an_optimizer_built_before_the_swap_trains_the_kept_weights_and_not_the_phi():
    model = small_vit()
    qkv_before = [block.attn.qkv.weight for block in model.blocks]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)  # steps of about lr, whatever the gradient
    with pytest.warns(AddedParametersWarning):
        swap_attention(model, phi='peripheral')
    assert [block.attn.qkv.weight for block in model.blocks] == qkv_before  # the same objects
    held = {id(p) for group in optimizer.param_groups for p in group['params']}
    missing = {name for name, p in model.named_parameters() if id(p) not in held}
    assert missing == phi_parameter_names(model) and len(missing) == 7 * DEPTH  # the peripheral Φp's 7 a layer
    assert {id(p) for p in posattn.parameters_added_by_swap(model)} == \
        {id(p) for name, p in model.named_parameters() if name in missing}

    named = dict(model.named_parameters())
    phi_before = {name: named[name].detach().clone() for name in missing}
    qkv_weight = model.blocks[0].attn.qkv.weight.detach().clone()
    training_step(model, optimizer)
    assert not torch.equal(model.blocks[0].attn.qkv.weight, qkv_weight)
    assert all(named[name].grad is not None and torch.equal(named[name], phi_before[name]) for name in missing)

    optimizer.add_param_group({'params': posattn.parameters_added_by_swap(model)})  # the fix the warning names
    training_step(model, optimizer)
    assert all(not torch.equal(named[name], phi_before[name]) for name in missing)


@pytest.mark.parametrize('build', ['timm', 'torchvision'])
def test_every_parameter_of_the_model_before_the_swap_stays_in_it(build):
    """An optimiser built before the swap keeps training everything it holds: no parameter is
    replaced by a copy (torchvision's in_proj_weight becomes the layer's qkv.weight, the object)."""
    if build == 'timm':
        model = small_vit()
    else:
        torchvision = pytest.importorskip('torchvision')
        model = torchvision.models.VisionTransformer(32, 8, DEPTH, 2, 32, 64, num_classes=5)
    before = {id(p) for p in model.parameters()}
    swapped_quietly(model, phi='rpb')
    after = {id(p) for p in model.parameters()}
    assert before < after
    assert after - before == {id(p) for p in posattn.parameters_added_by_swap(model)}


def test_one_warning_per_call_names_the_count_the_values_and_the_fix():
    model = small_vit()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        swap_attention(model, phi='irpe', method='product', mode='ctx', on='k')
    assert [w.category for w in caught] == [AddedParametersWarning]
    assert caught[0].filename == __file__  # it points at the caller's line
    phi = dict(model.named_parameters())
    values = sum(phi[name].numel() for name in phi_parameter_names(model))
    assert str(caught[0].message) == (
        f'swap_attention added {DEPTH} trainable parameters ({values:,} values) to '
        "timm.models.vision_transformer.VisionTransformer: the 'irpe' Φp of its 2 attention layers. An optimizer "
        'built after the swap holds them; one built before holds the weights the swap carried over (the same '
        "parameters) but never trains these: add them with optimizer.add_param_group({'params': "
        'posattn.parameters_added_by_swap(model)})')


@pytest.mark.parametrize('phi', ['none', 'alibi', 'rope'])
def test_a_phi_without_parameters_adds_none_and_warns_nothing(phi):
    model = small_vit()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        swap_attention(model, phi=phi)
    assert posattn.parameters_added_by_swap(model) == []


def test_converting_the_models_own_table_adds_nothing():
    """phi='own': the Φp holds the model's own tables, which an optimiser built before already holds."""
    model = timm.create_model('beit_base_patch16_224', pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                              num_heads=2, depth=DEPTH, num_classes=5)
    before = {id(p) for p in model.parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        swap_attention(model, phi='own')
    assert {id(p) for p in model.parameters()} == before
    assert posattn.parameters_added_by_swap(model) == []


def test_the_helper_finds_the_parameters_of_a_copy_and_inside_a_larger_module():
    wrapper = nn.Sequential(small_vit(), nn.Identity())
    swapped_quietly(wrapper)
    copied = copy.deepcopy(wrapper)
    names = {id(p): name for name, p in copied.named_parameters()}
    added = posattn.parameters_added_by_swap(copied)
    assert {names[id(p)] for p in added} == phi_parameter_names(copied) and len(added) == 7 * DEPTH
    assert [names[id(p)] for p in posattn.parameters_added_by_swap(copied[0])] == [names[id(p)] for p in added]
    assert posattn.parameters_added_by_swap(small_vit()) == []  # nothing swapped


@pytest.mark.slow
def test_the_example_trains_the_phi_of_a_swapped_timm_vit():
    result = subprocess.run([sys.executable, 'examples/swap_finetune.py'], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert result.returncode == 0, result.stderr
    assert 'AddedParametersWarning' not in result.stderr  # it builds the optimiser after the swap
    lines = result.stdout.splitlines()
    # The count, from the layers' names: 4 blocks of the peripheral Φp's 7 parameters.
    model = swapped_quietly(timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, depth=4,
                                              num_classes=4, global_pool='avg'))
    params = dict(model.named_parameters())
    values = sum(params[name].numel() for name in phi_parameter_names(model))
    assert lines[1] == f"swap_attention(model, phi='peripheral') added 28 Φp parameters ({values:,} values)"
    assert lines[2] == 'the optimiser holds 28 of them'
    losses = [float(re.fullmatch(rf'step {step}: loss (\S+)', line).group(1)) for step, line in
              enumerate(lines[3:8], start=1)]
    assert all(0 < loss < 10 for loss in losses)
    changed = re.fullmatch(r'after 5 steps, (\d+) of 28 Φp parameters changed \(largest change (\S+), '
                           r'smallest (\S+)\)', lines[8])
    assert changed.group(1) == '28' and float(changed.group(3)) > 0
