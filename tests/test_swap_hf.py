"""swap_attention on Hugging Face transformers' vision models (ViT, DeiT, ViT-MSN, I-JEPA, Pixio,
DINOv2 with and without registers, the CLIP, Chinese-CLIP, SigLIP and AIMv2 vision towers, BEiT,
Data2VecVision, Swin): 'none' keeps outputs and gradients in float64, names stay the model's, any
input size the model takes, every Φp trains, and what the swapped layer cannot give
(output_attentions, masks) is refused; the sweep over every vision model class finds no silent
wrong answer."""
import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import posattn
from conftest import assert_swap_keeps_outputs, assert_trains_with_every_phi, randomised
from posattn.swap import SwappedAttention, swap_attention
from posattn.swap.hf_vit import HfAttention

transformers = pytest.importorskip('transformers', minversion='5',
                                   reason="the transformers tests need transformers >= 5: pip install '.[hf]'")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
             patch_size=8)
NO_DROP_PATH = dict(drop_path_rate=0.0)  # BEiT's default drops paths while training: outputs would not compare
MODELS = {  # name: (build, the number of prefix tokens)
    'vit': (lambda: transformers.ViTForImageClassification(transformers.ViTConfig(**SMALL, num_labels=3)), 1),
    'deit_distilled': (lambda: transformers.DeiTForImageClassificationWithTeacher(
        transformers.DeiTConfig(**SMALL, num_labels=3)), 2),
    'vit_msn': (lambda: transformers.ViTMSNModel(transformers.ViTMSNConfig(**SMALL)), 1),
    'ijepa': (lambda: transformers.IJepaModel(transformers.IJepaConfig(**SMALL)), 0),
    'pixio': (lambda: transformers.PixioModel(transformers.PixioConfig(**SMALL, n_cls_tokens=3, **NO_DROP_PATH)), 3),
    'dinov2': (lambda: transformers.Dinov2Model(transformers.Dinov2Config(**SMALL)), 1),
    'dinov2_registers': (lambda: transformers.Dinov2WithRegistersModel(
        transformers.Dinov2WithRegistersConfig(**SMALL, num_register_tokens=3)), 4),
    'clip_vision': (lambda: transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**SMALL)), 1),
    'siglip_vision': (lambda: transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**SMALL)), 0),
    'chinese_clip_vision': (lambda: transformers.ChineseCLIPVisionModel(transformers.ChineseCLIPVisionConfig(**SMALL)),
                            1),
    'aimv2_vision': (lambda: transformers.Aimv2VisionModel(transformers.Aimv2VisionConfig(**SMALL, use_head=True)), 0),
    'aimv2_vision_native': (lambda: transformers.Aimv2VisionModel(transformers.Aimv2VisionConfig(
        **SMALL, is_native=True, use_head=False)), 0),
    'beit': (lambda: transformers.BeitForImageClassification(transformers.BeitConfig(
        **SMALL, **NO_DROP_PATH, use_relative_position_bias=True, num_labels=3)), 1),
    'swin': (lambda: transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=3,
        **NO_DROP_PATH)), 0),
    'data2vec_vision': (lambda: transformers.Data2VecVisionForImageClassification(transformers.Data2VecVisionConfig(
        **SMALL, **NO_DROP_PATH, use_relative_position_bias=True, num_labels=3)), 1),
    'beit_shared_table': (lambda: transformers.BeitModel(transformers.BeitConfig(
        **SMALL, **NO_DROP_PATH, use_relative_position_bias=False, use_shared_relative_position_bias=True)), 1),
}


def images(size=32, dtype=torch.float64):
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=dtype)


def layers(model):
    return [m for m in model.modules() if isinstance(m, SwappedAttention)]


def first_tensor(output):
    return output.logits if hasattr(output, 'logits') else output.last_hidden_state


@pytest.mark.parametrize('name', list(MODELS))
def test_none_keeps_outputs_gradients_and_names(name):
    build, prefix = MODELS[name]
    model = build().double()
    keys = set(model.state_dict())
    swapped = assert_swap_keeps_outputs(model, images(), atol=1e-10)
    assert set(swapped.state_dict()) == keys  # the model's names: its checkpoints load
    assert {layer.num_prefix_tokens for layer in layers(swapped)} == {prefix}
    assert all(isinstance(layer, HfAttention) for layer in layers(swapped))
    for layer in layers(swapped):  # the model's output projection serves under its own name, no other slot
        assert 'proj' not in layer._modules and layer.output_projection() is layer.get_submodule(layer.output_name)
    x, x_swapped = images().requires_grad_(), images().requires_grad_()
    first_tensor(model.train()(x)).square().sum().backward()  # randomised by the check above
    first_tensor(swapped.train()(x_swapped)).square().sum().backward()
    torch.testing.assert_close(x_swapped.grad, x.grad, rtol=0, atol=1e-10)
    swapped_parameters = dict(swapped.named_parameters())
    for param_name, param in model.named_parameters():
        torch.testing.assert_close(swapped_parameters[param_name].grad, param.grad, rtol=0, atol=1e-10,
                                   msg=param_name)


@pytest.mark.parametrize('name', list(MODELS))
def test_every_phi_trains(name):
    """On the base model's every token (a classifier's logits read the class token alone, so the last
    layer's grid queries get no gradient)."""
    assert_trains_with_every_phi(lambda: MODELS[name][0]().base_model, images(dtype=torch.float32))


@pytest.mark.parametrize('name', ['vit', 'dinov2', 'clip_vision', 'beit'])
def test_another_input_size_gives_the_phi_its_grid(name):
    """At 48 x 48 (interpolate_pos_encoding where the model asks for it) the swapped model with 'none'
    is the model, and a Φp sees the 6 x 6 grid behind the model's prefix tokens."""
    build, prefix = MODELS[name]
    model = randomised(build().double())
    x = images(48)
    interpolate = dict(interpolate_pos_encoding=True) if name != 'dinov2' else {}
    swapped = swap_attention(copy.deepcopy(model), phi='none')
    with torch.no_grad():
        torch.testing.assert_close(first_tensor(swapped(x, **interpolate)), first_tensor(model(x, **interpolate)),
                                   rtol=0, atol=1e-10)
    peripheral = swap_attention(copy.deepcopy(model), phi='peripheral')
    seen = []
    for layer in layers(peripheral):
        layer.logits_probe.register_forward_hook(lambda module, args, out: seen.append(args[3]))
    with torch.no_grad():
        peripheral(x, **interpolate)
    assert seen == [posattn.TokenGrid(6, 6, prefix)] * 2


def test_the_clip_model_swaps_its_vision_tower_only():
    config = transformers.CLIPConfig(text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                      intermediate_size=64, vocab_size=50),
                                     vision_config=SMALL, projection_dim=16)
    model = swap_attention(transformers.CLIPModel(config), phi='peripheral')
    assert [type(m).__name__ for m in model.text_model.modules() if 'Attention' in type(m).__name__] == ['CLIPAttention']
    assert len(layers(model.vision_model)) == 2
    with torch.no_grad():
        model.get_image_features(pixel_values=images(dtype=torch.float32))


def test_fixed_positions_are_not_dropped_silently():
    """AIMv2's native variant adds a sinusoidal embedding computed in its forward: own_positions=False
    is refused (the model unchanged); its learned variant's embedding is zeroed and frozen."""
    native = MODELS['aimv2_vision_native'][0]()
    before = copy.deepcopy(native.state_dict())
    with pytest.raises(ValueError, match='own_positions=False cannot drop .*sinusoidal'):
        swap_attention(native, phi='rpb', own_positions=False)
    assert not layers(native) and all(torch.equal(before[k], v) for k, v in native.state_dict().items())
    learned = swap_attention(MODELS['aimv2_vision'][0](), phi='rpb', own_positions=False)
    embedding = learned.embeddings.position_embedding.weight
    assert not embedding.requires_grad and not embedding.any()


def test_output_attentions_and_masks_are_refused():
    """With the eager implementation, the one where transformers collects attention weights."""
    config = transformers.ViTConfig(**SMALL, num_labels=3, attn_implementation='eager')
    model = swap_attention(transformers.ViTForImageClassification(config), phi='none')
    with pytest.raises(ValueError, match='output_attentions'):
        model(images(dtype=torch.float32), output_attentions=True)
    model.config.output_attentions = True
    with pytest.raises(ValueError, match='output_attentions'):
        model(images(dtype=torch.float32))
    with pytest.raises(ValueError, match='no attention mask'):
        layers(model)[0](torch.zeros(1, 17, 32), torch.zeros(1, 1, 17, 17))


@pytest.mark.parametrize('build,reason', [
    (lambda: transformers.ViTMAEModel(transformers.ViTMAEConfig(**SMALL)), 'random subset'),
    (lambda: transformers.Swinv2Model(transformers.Swinv2Config(image_size=32, embed_dim=16, depths=[2],
                                                                 num_heads=[2], window_size=4)), 'cosine attention'),
], ids=['vit_mae', 'swinv2'])
def test_refused_with_the_reason(build, reason):
    model = build()
    with pytest.raises(TypeError, match=reason):
        swap_attention(model)


@pytest.mark.parametrize('phi,options', [('peripheral', {}), (['rpb', 'alibi'], dict(phi_cfg=[dict(table_size=(3, 3)), None]))],
                         ids=['peripheral', 'rpb+alibi'])
def test_save_pretrained_and_back(tmp_path, phi, options):
    """The swap recorded in the config, the Φp swapped in again and every saved weight loaded: the
    same outputs, and the Φp's trained values back."""
    from posattn.swap import from_pretrained
    model = swap_attention(randomised(MODELS['vit'][0]()), phi=phi, **options)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if '.phi.' in name:
                param.normal_()
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(transformers.ViTForImageClassification, tmp_path).eval()
    assert set(loaded.state_dict()) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images(dtype=torch.float32)).logits, model(images(dtype=torch.float32)).logits,
                                   rtol=0, atol=0)


@pytest.mark.parametrize('name,phi', [('vit', 'peripheral'), ('swin', 'own')])
def test_transformers_load_report_lists_no_phi_key(tmp_path, capfd, name, phi):
    """transformers loads the weights of the model before the swap: its report (and the loading info
    it returns) lists no Φp key as unexpected, and no key of the model's own that a converted Φp
    holds ('own': Swin's tables) as missing; every saved weight is back."""
    from posattn.swap import from_pretrained
    model = swap_attention(randomised(MODELS[name][0]()), phi=phi)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if '.phi.' in param_name:
                param.normal_()
    model.save_pretrained(tmp_path)
    capfd.readouterr()
    loaded, info = from_pretrained(type(model), tmp_path, output_loading_info=True)
    assert not info['unexpected_keys'] and not info['missing_keys'] and not info['mismatched_keys'], info
    assert 'UNEXPECTED' not in capfd.readouterr().err and loaded.config.name_or_path == str(tmp_path)
    for key, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], tensor, rtol=0, atol=0, msg=key)


def test_pytorch_weights_load_and_a_folder_without_weights_is_named(tmp_path):
    """A folder whose weights are a PyTorch file (pytorch_model.bin, as older transformers wrote them)
    loads as one of safetensors does, read weights-only; one with neither names what it holds and needs."""
    from posattn.swap import from_pretrained
    from safetensors.torch import load_file
    model = swap_attention(randomised(MODELS['vit'][0]()), phi='rpb', table_size=(3, 3))
    with torch.no_grad():
        model.vit.layers[1].attention.phi.relative_position_bias_table.normal_()
    model.save_pretrained(tmp_path)
    torch.save(load_file(str(tmp_path / 'model.safetensors')), tmp_path / 'pytorch_model.bin')
    (tmp_path / 'model.safetensors').unlink()
    loaded = from_pretrained(transformers.ViTForImageClassification, tmp_path)
    for key, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], tensor, rtol=0, atol=0, msg=key)
    (tmp_path / 'pytorch_model.bin').rename(tmp_path / 'weights.pt')
    with pytest.raises(FileNotFoundError, match=rf'^{re.escape(str(tmp_path))} holds no weights save_pretrained writes \(one of '
                                                r'model\.safetensors, model\.safetensors\.index\.json, '
                                                r'pytorch_model\.bin, pytorch_model\.bin\.index\.json\); it '
                                                r'holds: config\.json, weights\.pt$'):
        from_pretrained(transformers.ViTForImageClassification, tmp_path)


def test_a_layer_whose_phi_is_not_the_one_recorded_is_refused(tmp_path):
    """The config records each swapped layer's Φp; one that the swap builds otherwise (here: the
    record edited to RoPE's other axis order) is refused, naming the layer and both."""
    from posattn.swap import from_pretrained
    swap_attention(MODELS['vit'][0](), phi='rope').save_pretrained(tmp_path)
    config = json.loads((tmp_path / 'config.json').read_text())
    assert config['posattn_swap']['phi_records'][1]['']['settings']['axis_order'] == 'yx'
    config['posattn_swap']['phi_records'][1]['']['settings']['axis_order'] = 'xy'
    (tmp_path / 'config.json').write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"swapped layer 1: the weights are those of a rope Φp with axis_order='xy', "
                                         r"this one has axis_order='yx'"):
        from_pretrained(transformers.ViTForImageClassification, tmp_path)


def test_a_folder_of_an_unswapped_model_is_named(tmp_path):
    from posattn.swap import from_pretrained
    MODELS['vit'][0]().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match='records no posattn swap'):
        from_pretrained(transformers.ViTForImageClassification, tmp_path)


@pytest.mark.parametrize('name', ['beit', 'beit_shared_table', 'data2vec_vision'])
def test_beits_relative_bias_is_the_first_phi_or_dropped(name):
    """Kept: the bias the model computes from its table(s) is added by the first member of each
    layer's Φp; dropped (own_positions=False): the Φp alone, the tables frozen, and the outputs those
    of the model with its tables at zero."""
    from posattn.swap.given import GivenBias
    model = randomised(MODELS[name][0]().double())
    with torch.no_grad():  # tables large enough to matter
        for param_name, param in model.named_parameters():
            if param_name.endswith('relative_position_bias_table'):
                param.mul_(40)
    kept = swap_attention(copy.deepcopy(model), phi='alibi')
    assert all(type(layer.phi).__name__ == 'PhiStack' and isinstance(layer.phi[0], GivenBias) for layer in layers(kept))
    dropped = swap_attention(copy.deepcopy(model), phi='none', own_positions=False)
    tables = [p for n, p in dropped.named_parameters() if n.endswith('relative_position_bias_table')]
    assert tables and not any(table.requires_grad for table in tables)
    without_tables = copy.deepcopy(model)
    with torch.no_grad():
        for param_name, param in without_tables.named_parameters():
            if param_name.endswith('relative_position_bias_table'):
                param.zero_()
        torch.testing.assert_close(first_tensor(dropped(images())), first_tensor(without_tables(images())),
                                   rtol=0, atol=1e-10)
        assert (first_tensor(dropped(images())) - first_tensor(model(images()))).abs().max() > 1e-5  # they mattered


def drawn_swin():
    """The small Swin in float64, its tables large enough to matter."""
    model = randomised(MODELS['swin'][0]().double())
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith('relative_position_bias_table'):
                param.mul_(40)
    return model


@pytest.mark.parametrize('size', [32, 36], ids=['windows fit', 'padded windows'])
def test_swin_own_is_the_model_and_none_keeps_it(size):
    """phi='own' (each table in an rpb) and phi='none' (the tables kept first) give the model's
    outputs in float64, with shift masks and padded windows; 'own' keeps one copy of each table,
    under the Φp's name, and loads the model's weights strictly."""
    from posattn.phi.rpb import RelativePositionBias
    model = drawn_swin()
    x = images(size)
    with torch.no_grad():
        expected = model(x).logits
        for phi in ('own', 'none'):
            swapped = swap_attention(copy.deepcopy(model), phi=phi)
            torch.testing.assert_close(swapped(x).logits, expected, rtol=0, atol=1e-10, msg=phi)
    converted = swap_attention(copy.deepcopy(model), phi='own')
    assert all(isinstance(layer.phi, RelativePositionBias) for layer in layers(converted))
    tables = [key for key in converted.state_dict() if key.endswith('relative_position_bias_table')]
    assert len(tables) == 4 and all('.attention.phi.' in key for key in tables)
    converted.load_state_dict(model.state_dict())  # the model's names are renamed onto the Φp


def test_swin_keeps_its_tables_first_and_drops_them_on_request():
    from posattn.swap.given import GivenBias
    model = drawn_swin()
    kept = swap_attention(copy.deepcopy(model), phi='peripheral')
    assert all(isinstance(layer.phi[0], GivenBias) for layer in layers(kept))
    assert {layer.current_grid() for layer in layers(kept)} == {posattn.TokenGrid(4, 4)}
    dropped = swap_attention(copy.deepcopy(model), phi='none', own_positions=False)
    assert not any(p.requires_grad for n, p in dropped.named_parameters() if n.endswith('relative_position_bias_table'))
    with torch.no_grad():
        assert (dropped(images()).logits - model(images()).logits).abs().max() > 1e-5


def test_the_analyses_read_a_swapped_model():
    """In place of output_attentions: the maps of every swapped layer, on the layer's grid."""
    from posattn.analysis import collect_attention_maps
    model = swap_attention(randomised(MODELS['dinov2_registers'][0]()), phi='peripheral')
    maps = collect_attention_maps(model, images(dtype=torch.float32))
    assert len(maps) == 2
    for layer_maps in maps.values():
        assert layer_maps.mixed.shape[-2:] == (16, 16)  # the 4 x 4 grid's queries and keys, prefix tokens cut


def test_options_json_cannot_hold_leave_the_config_writable(tmp_path):
    """Such options are not recorded: save_pretrained still works, and loading says what to do."""
    from posattn.swap import from_pretrained
    import numpy as np
    model = swap_attention(MODELS['vit'][0](), phi='rpb', table_size=(np.int64(3), np.int64(3)))  # not JSON
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match='JSON cannot hold'):
        from_pretrained(transformers.ViTForImageClassification, tmp_path)


@pytest.mark.parametrize('name', ['beit', 'beit_shared_table', 'data2vec_vision'])
def test_beit_own_is_the_model(name):
    """phi='own' in float64 at the tables' grid: each layer's table in an rpb (one copy, under the
    Φp's name, the model's name renamed on load), or the shared bias as given."""
    from posattn.phi.rpb import RelativePositionBias
    from posattn.swap.given import GivenBias
    model = randomised(MODELS[name][0]().double())
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith('relative_position_bias_table'):
                param.mul_(40)
        expected = first_tensor(model(images()))
        converted = swap_attention(copy.deepcopy(model), phi='own')
        torch.testing.assert_close(first_tensor(converted(images())), expected, rtol=0, atol=1e-10)
    per_layer = name != 'beit_shared_table'
    assert all(isinstance(layer.phi, RelativePositionBias if per_layer else GivenBias) for layer in layers(converted))
    tables = [key for key in converted.state_dict() if key.endswith('relative_position_bias_table')]
    assert len(tables) == (2 if per_layer else 1)
    assert all('.attention.phi.' in key for key in tables) == per_layer
    converted.load_state_dict(model.state_dict())  # transformers' names load
    with torch.no_grad():
        torch.testing.assert_close(first_tensor(converted(images())), expected, rtol=0, atol=1e-10)


@pytest.mark.slow
def test_the_sweep_tool_sorts_models_into_exact_and_refused(tmp_path):
    import json
    import sys
    from conftest import run_tool
    out = run_tool(sys.executable, 'tools/sweep_transformers.py', '--out', str(tmp_path), '--only', 'ViTModel',
                   'ResNetModel', 'ViTMAEModel', timeout=600)
    rows = json.loads((tmp_path / 'sweep.json').read_text())['rows']
    assert {name: row['status'] for name, row in rows.items()} == dict(ViTModel='exact', ResNetModel='refused',
                                                                       ViTMAEModel='refused')
    assert 'random subset' in rows['ViTMAEModel']['detail'] and '1 exact, 2 refused, 0 WRONG, 0 skipped' in out
    assert '| `ViTModel` | exact |' in (tmp_path / 'sweep.md').read_text()


def test_plain_weights_load_as_timms_do():
    """A strict load of the unswapped model's weights fails for want of the Φp keys;
    load_original_weights loads them, every Φp keeping its initialisation."""
    plain = randomised(MODELS['vit'][0]())
    swapped = swap_attention(MODELS['vit'][0](), phi='peripheral')
    with pytest.raises(RuntimeError, match='Missing key'):
        swapped.load_state_dict(plain.state_dict())
    with pytest.warns(UserWarning, match='no Φp keys'):
        fresh = posattn.load_original_weights(swapped, plain.state_dict())
    assert len(fresh) == 14 and all('.attention.phi.' in key for key in fresh)
    assert all(torch.equal(swapped.state_dict()[key], value) for key, value in plain.state_dict().items())


@pytest.mark.parametrize('name', ['beit', 'data2vec_vision', 'swin'])
def test_own_in_a_list_keeps_the_table_once_and_loads_the_models_names(name):
    """phi=['own', 'alibi']: the table is member 0's (phi.0.*), transformers' name loads onto it."""
    model = randomised(MODELS[name][0]().double())
    stacked = swap_attention(copy.deepcopy(model), phi=['own', 'alibi'])
    tables = [key for key in stacked.state_dict() if key.endswith('relative_position_bias_table')]
    assert tables and all('.phi.0.relative_position_bias_table' in key for key in tables)
    stacked.load_state_dict(model.state_dict())


@pytest.mark.slow
def test_the_sweep_over_every_vision_model_class_finds_nothing_wrong(tmp_path):
    """tools/sweep_transformers.py: every base model class of the installed transformers that takes
    pixel_values swaps exactly with 'none' or is refused with a reason (or cannot be built here);
    none changes an output. The families above are among the exact."""
    tool = Path(__file__).resolve().parents[1] / 'tools' / 'sweep_transformers.py'
    result = subprocess.run([sys.executable, str(tool), '--out', str(tmp_path)], capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = json.loads((tmp_path / 'sweep.json').read_text())['rows']
    assert not [name for name, row in rows.items() if row['status'] == 'WRONG']
    assert all(row['detail'] for row in rows.values() if row['status'] == 'refused')
    exact = {name for name, row in rows.items() if row['status'] == 'exact'}
    assert {'ViTModel', 'DeiTModel', 'Dinov2Model', 'BeitModel', 'Data2VecVisionModel', 'SwinModel',
            'CLIPVisionModel', 'SiglipVisionModel'} <= exact
    assert rows['ViTMAEModel']['status'] == rows['Swinv2Model']['status'] == 'refused'
