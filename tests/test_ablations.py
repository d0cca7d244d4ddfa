"""The paper's ablations as PerViT options (Table 1's components, Table 5's Φp initialisations,
Tab. A3's frozen Φp) and their configs in configs/ablations/."""
import copy

import pytest
import torch
import torch.nn.functional as F

import posattn
from posattn.grid import TokenGrid
from posattn.models.pervit import PERVIT_ARCHS, PatchStem, PerViT, PerViTBlock
from posattn.phi.none import NoPosition
from posattn.phi.peripheral import PeripheralPhi, peripheral_init
from conftest import REPO

TINY = dict(PERVIT_ARCHS['tiny'])
SMALL_TINY = dict(TINY, depths=(1, 1, 1, 1))  # four blocks, one per stage: fast, every stage boundary kept


def build(**kwargs):
    torch.manual_seed(0)
    return PerViT(**dict(SMALL_TINY, num_classes=5), **kwargs)


def phi_parameters(model):
    return {name: p for name, p in model.named_parameters()
            if name.startswith('distance_embedding.') or '.attn.phi.' in name}


def training_step(model, size=(48, 64)):
    """One AdamW step on random images; returns the parameters before it."""
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    images = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model.train()(images), torch.tensor([0, 3])).backward()
    optimizer.step()
    return before


def test_the_default_options_build_pervit_bit_for_bit():
    explicit = build(phi='peripheral', phi_init='peripheral', phi_trainable=True, stem='conv', cpe=True)
    default = build()
    assert list(explicit.state_dict()) == list(default.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(explicit.state_dict().values(), default.state_dict().values()))
    assert all(p.requires_grad for p in default.parameters())
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(explicit.eval()(images), default.eval()(images))


def test_without_phi_every_block_is_plain_attention_and_every_parameter_trains():
    model = build(phi='none')
    assert not phi_parameters(model) and not hasattr(model, 'distance_embedding')
    assert all(isinstance(block.attn.phi, NoPosition) for block in model.blocks)
    before = training_step(model)
    assert all(not torch.equal(p, before[name]) for name, p in model.named_parameters()), 'a parameter got no update'
    # the same weights without Φp: each block's attention is softmax(q k^T / sqrt(d)) v
    block = model.blocks[0].eval()
    x, grid = torch.randn(2, 12, block.norm1.normalized_shape[0]), TokenGrid(3, 4)
    attn = block.attn
    q, k, v = attn.split_heads(attn.qkv(x))
    expected = attn.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
    with torch.no_grad():
        torch.testing.assert_close(attn(x, grid), expected, rtol=1e-5, atol=1e-6)


def test_patch_stem_is_a_16x16_patch_convolution_of_the_zero_padded_image():
    stem = PatchStem(3, 8)
    images = torch.randn(2, 3, 50, 70, dtype=torch.float64)
    stem = stem.double()
    tokens, grid = stem(images)
    assert (grid.height, grid.width) == (4, 5)  # ceil(50 / 16), ceil(70 / 16)
    padded = torch.zeros(2, 3, 64, 80, dtype=torch.float64)
    padded[:, :, :50, :70] = images
    patches = padded.unfold(2, 16, 16).unfold(3, 16, 16)  # (B, 3, 4, 5, 16, 16)
    expected = torch.einsum('bcyxij,ocij->byxo', patches, stem.proj.weight) + stem.proj.bias
    torch.testing.assert_close(tokens, expected.reshape(2, 20, 8), rtol=1e-12, atol=1e-12)
    model = build(stem='patch')
    assert model.stem.stride == 16 and model(torch.randn(1, 3, 40, 33)).shape == (1, 5)
    with pytest.raises(ValueError, match='expected images'):
        model(torch.randn(1, 1, 32, 32))


def test_without_cpe_the_attention_sees_the_tokens_themselves():
    """cpe=False equals the CPE convolution set to the identity (a 1 at each kernel's centre)."""
    torch.manual_seed(0)
    phi = PeripheralPhi(4)
    without = PerViTBlock(32, 32, 4, phi, cpe=False).eval()
    with_identity = PerViTBlock(32, 32, 4, copy.deepcopy(phi), cpe=True).eval()
    state = dict(without.state_dict())
    kernel = torch.zeros(32, 1, 3, 3)
    kernel[:, 0, 1, 1] = 1
    state.update({'cpe.proj.weight': kernel, 'cpe.proj.bias': torch.zeros(32)})
    with_identity.load_state_dict(state)
    assert not any(name.startswith('cpe.') for name in without.state_dict())
    x, grid = torch.randn(2, 20, 32), TokenGrid(4, 5)
    with torch.no_grad():
        torch.testing.assert_close(without(x, grid), with_identity(x, grid), rtol=1e-6, atol=1e-6)


def second_norms(model):
    return [(block.attn.phi.norm2_bias.detach(), block.attn.phi.norm2_weight.detach()) for block in model.blocks]


def test_phi_initialisations():
    layers = 4
    peripheral = second_norms(build(phi_init='peripheral'))
    for i, (size, strength) in enumerate(peripheral):
        expected_size, expected_strength = peripheral_init(i, layers)
        assert torch.equal(size, torch.full((4,), expected_size))
        assert torch.equal(strength, torch.full((4,), expected_strength))
    assert all(torch.equal(size, torch.full((4,), -5.0)) and torch.equal(strength, torch.full((4,), 3.0))
               for size, strength in second_norms(build(phi_init='conv')))
    rand = build(phi_init='rand')
    default = build()
    parameters, deterministic = phi_parameters(rand), phi_parameters(default)
    assert set(parameters) == set(deterministic)
    for name, p in parameters.items():  # every Φp parameter drawn, none left at the deterministic init
        assert not torch.equal(p, deterministic[name]) and p.abs().max() <= 2, name
    drawn = torch.cat([p.detach().flatten() for p in parameters.values()])
    assert 0.7 < drawn.std() < 1.0 and abs(drawn.mean()) < 0.05  # N(0, 1) truncated at 2: std 0.88
    assert not torch.equal(rand.blocks[0].attn.phi.proj1_weight, rand.blocks[1].attn.phi.proj1_weight)
    log_phi = rand.blocks[2].attn.phi.log_position_attention(5, 6)
    assert torch.isfinite(log_phi).all() and (log_phi <= 0).all()
    training_step(rand)
    with pytest.raises(ValueError, match="unknown Φp initialisation 'gauss'"):
        PeripheralPhi(4, init='gauss')


@pytest.mark.parametrize('phi_init', ['peripheral', 'conv', 'rand'])
def test_a_frozen_phi_keeps_its_initialisation_through_training(phi_init):
    model = build(phi_init=phi_init, phi_trainable=False)
    frozen = phi_parameters(model)
    assert frozen and not any(p.requires_grad for p in frozen.values())
    before = training_step(model)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) == (name in frozen), name
    model.eval()  # frozen: the eval cache serves Φp even with gradients on
    phi = model.blocks[1].attn.phi
    q = torch.empty(1, 4, 20, 8)
    first = phi.logits_bias(q, q, TokenGrid(4, 5))
    assert phi.logits_bias(q, q, TokenGrid(4, 5)) is first


def test_bad_ablation_options_are_named():
    with pytest.raises(ValueError, match="phi is 'peripheral' or 'none', got 'irpe'"):
        build(phi='irpe')
    with pytest.raises(ValueError, match="unknown stem 'linear'"):
        build(stem='linear')
    with pytest.raises(ValueError, match="with phi='none' there is none"):
        build(phi='none', phi_init='conv')
    with pytest.raises(ValueError, match="with phi='none' there is none"):
        build(phi='none', phi_trainable=False)


def test_options_reach_create_model_and_the_openmmlab_backbone():
    model = posattn.create_model('pervit_tiny', num_classes=3, stem='patch', cpe=False, phi_init='conv')
    assert isinstance(model.stem, PatchStem) and isinstance(model.blocks[0].cpe, NoPosition)
    assert model.blocks[5].attn.phi.init == 'conv'
    from posattn_openmmlab.backbones import PosattnPerViT
    backbone = PosattnPerViT(phi='none', stem='patch', frozen_stages=1)  # freezing without a distance embedding
    assert isinstance(backbone.model.stem, PatchStem) and not phi_parameters(backbone.model)
    assert backbone(torch.randn(1, 3, 64, 64))[0].shape == (1, 280, 4, 4)


# configs/ablations: each row's config is ../pervit_t_imagenet.py plus exactly its change.
WIDE = dict(embed_dims=(136, 200, 232, 288), depths=(2, 2, 6, 2), num_heads=4, stem_dims=(48, 64, 96, 128))
ROWS = {
    'pervit-t_components-a_imagenet.py': ({}, 280),
    'pervit-t_components-b_imagenet.py': (dict(phi='none'), 280),
    'pervit-t_components-d_imagenet.py': (dict(stem='patch'), 280),
    'pervit-t_components-e_imagenet.py': (dict(cpe=False), 280),
    'pervit-t_components-f_imagenet.py': (dict(phi='none', stem='patch', arch=WIDE), 288),
    'pervit-t_components-g_imagenet.py': (dict(phi='none', cpe=False), 280),
    'pervit-t_components-h_imagenet.py': (dict(stem='patch', cpe=False, arch=WIDE), 288),
    'pervit-t_components-i_imagenet.py': (dict(phi='none', stem='patch', cpe=False, arch=WIDE), 288),
    **{f'pervit-t_init-{init}_imagenet.py': (dict(phi_init=init), 280) for init in ('peripheral', 'conv', 'rand')},
    **{f'pervit-t_init-{init}-frozen_imagenet.py': (dict(phi_init=init, phi_trainable=False), 280)
       for init in ('peripheral', 'conv', 'rand')},
}


SUBSAMPLED = {'pervit-s_imagenet-50pct.py': (0.5, 600, 10), 'pervit-s_imagenet-25pct.py': (0.25, 1200, 20)}


def test_every_ablation_config_is_listed():
    assert sorted(p.name for p in (REPO / 'configs' / 'ablations').glob('*.py')) == sorted([*ROWS, *SUBSAMPLED])


def test_subsampled_dataset_keeps_a_seeded_fraction_of_every_class():
    import numpy as np
    from mmpretrain.registry import DATASETS
    import posattn_openmmlab  # noqa: F401 (registers the datasets)
    full_cfg = dict(type='PositionalShapes', split='train', num_images=300, img_size=50)
    full = DATASETS.build(full_cfg)
    half = DATASETS.build(dict(type='SubsampledDataset', fraction=0.5, seed=3, dataset=full_cfg))
    labels, kept = np.asarray(full.get_gt_labels()), np.asarray(half.get_gt_labels())
    for label in np.unique(labels):
        assert (kept == label).sum() == round(0.5 * (labels == label).sum())
    assert len(set(half.indices.tolist())) == len(half) and half.metainfo == full.metainfo
    for i in (0, len(half) - 1):
        assert np.array_equal(half[i]['img'], full[int(half.indices[i])]['img'])
        assert half.get_cat_ids(i) == [int(labels[half.indices[i]])]
    again = DATASETS.build(dict(type='SubsampledDataset', fraction=0.5, seed=3, dataset=full_cfg))
    other = DATASETS.build(dict(type='SubsampledDataset', fraction=0.5, seed=4, dataset=full_cfg))
    assert np.array_equal(again.indices, half.indices) and not np.array_equal(other.indices, half.indices)
    tiny = DATASETS.build(dict(type='SubsampledDataset', fraction=1e-6, dataset=full))
    assert sorted(tiny.get_gt_labels().tolist()) == sorted(np.unique(labels).tolist())  # one image a class
    for fraction in (0, 1.5):
        with pytest.raises(ValueError, match='fraction must be in'):
            DATASETS.build(dict(type='SubsampledDataset', fraction=fraction, dataset=full))


@pytest.mark.parametrize('name', sorted(SUBSAMPLED))
def test_subsampled_config_is_pervit_s_on_part_of_imagenet_for_as_many_images(name):
    from mmengine.config import Config
    fraction, epochs, warmup = SUBSAMPLED[name]
    base = Config.fromfile(REPO / 'configs' / 'pervit_s_imagenet.py').to_dict()
    cfg = Config.fromfile(REPO / 'configs' / 'ablations' / name).to_dict()
    expected = copy.deepcopy(base)
    expected['train_dataloader']['dataset'] = dict(type='SubsampledDataset', fraction=fraction, seed=0,
                                                   dataset=base['train_dataloader']['dataset'])
    expected['train_cfg']['max_epochs'] = epochs
    for scheduler, key in zip(expected['param_scheduler'], ('end', 'begin')):
        scheduler[key] = warmup
    assert cfg == expected
    assert fraction * epochs == base['train_cfg']['max_epochs'] and fraction * warmup == 5
    # the config's loader (DeiT's repeated-augmentation sampler) over the wrapper, on embedded images
    from mmengine.registry import init_default_scope
    from mmengine.runner import Runner
    import posattn_openmmlab  # noqa: F401
    init_default_scope(cfg['default_scope'])
    loader_cfg = copy.deepcopy(cfg['train_dataloader'])
    loader_cfg.update(batch_size=4, num_workers=0, persistent_workers=False)
    loader_cfg['dataset']['dataset'] = dict(type='PositionalShapes', num_images=200, pipeline=[dict(type='PackInputs')])
    loader = Runner.build_dataloader(loader_cfg, seed=0)
    assert abs(len(loader.dataset) - 200 * fraction) < 6  # rounded per class, 6 classes
    batch = next(iter(loader))
    assert len(batch['inputs']) == 4 and len(batch['data_samples']) == 4


def paper_gmac(backbone):
    """GMAC of one 224 x 224 image as the paper counts them (docs/models.md): Φp cached, the
    attention products (SDPA, which FlopCounterMode does not count on the CPU) left out."""
    from torch.utils.flop_counter import FlopCounterMode
    images = torch.randn(1, 3, 224, 224)
    backbone.eval()
    with torch.no_grad():
        backbone(images)  # fills the Φp caches
        with FlopCounterMode(display=False) as counter:
            backbone(images)
    return counter.get_total_flops() / 2 / 1e9


@pytest.mark.parametrize('name', sorted(ROWS))
def test_ablation_config_is_the_base_recipe_plus_its_row_and_trains_a_step(name):
    from mmengine.config import Config
    from mmpretrain.registry import MODELS
    from mmpretrain.structures import DataSample
    change, width = ROWS[name]
    base = Config.fromfile(REPO / 'configs' / 'pervit_t_imagenet.py').to_dict()
    cfg = Config.fromfile(REPO / 'configs' / 'ablations' / name)
    expected = copy.deepcopy(base)
    expected['model']['backbone'].update(change)
    expected['model']['head']['in_channels'] = width
    assert cfg.to_dict() == expected
    model = MODELS.build(cfg.model)
    model.init_weights()
    backbone = model.backbone.model
    frozen = change.get('phi_trainable') is False
    assert all(p.requires_grad != frozen for p in phi_parameters(backbone).values())
    if not change or set(change) <= {'phi_init', 'phi_trainable'}:  # PerViT-T's layout: the paper's 7.6 M
        assert sum(p.numel() for p in model.parameters()) == 7_590_744
    if 'arch' in change:  # widened to the paper's 1.5 GFLOPs (its footnote: comparable to the others)
        assert abs(paper_gmac(backbone) - 1.5) < 0.01
    samples = [DataSample().set_gt_label(label) for label in (1, 7)]
    losses = model(torch.randn(2, 3, 64, 64), samples, mode='loss')
    sum(losses.values()).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
