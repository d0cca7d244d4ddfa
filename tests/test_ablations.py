"""The paper's ablations as PerViT options (Table 1's components, Table 5's Φp initialisations,
Tab. A3's frozen Φp) and their configs in configs/ablations/."""
import copy

import pytest
import torch
import torch.nn.functional as F

import posattn
from posattn.analysis import collect_attention_maps
from posattn.grid import TokenGrid
from posattn.models.pervit import PERVIT_ARCHS, PatchStem, PerViT, PerViTBlock
from posattn.phi.none import NoPosition
from posattn.phi.peripheral import PeripheralPhi, peripheral_init
from conftest import REPO, needs_openmmlab

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
    explicit = build(phi='peripheral', phi_init='peripheral', phi_trainable=True, stem='conv', cpe=True, content=True,
                     phi_embedding='euc', phi_neighbourhood=True, phi_multi_layer=True)
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


def test_without_content_each_layer_attends_by_phi_alone():
    """content=False: out = proj(softmax(log Φp) v), against the formula in float64; no q, k."""
    model = build(content=False)
    attn = model.blocks[0].attn.double().eval()
    assert attn.qkv is None and attn.v.weight.shape == (128, 128) and 'content=False' in repr(attn)
    x, grid = torch.randn(2, 20, 128, dtype=torch.float64), TokenGrid(4, 5)
    v = (x @ attn.v.weight.t()).view(2, 20, 4, 32).transpose(1, 2)
    mixed = attn.phi.log_position_attention(4, 5, model.distance_embedding.double()).softmax(-1)  # (heads, 20, 20)
    expected = attn.proj((mixed @ v).transpose(1, 2).reshape(2, 20, 128))
    for mode in (False, True):
        torch.testing.assert_close(attn.train(mode)(x, grid, distance_embedding=model.distance_embedding), expected,
                                   rtol=1e-10, atol=1e-12)
    maps = collect_attention_maps(build(content=False), torch.randn(1, 3, 64, 80))
    first = maps['blocks.0.attn']
    torch.testing.assert_close(first.mixed, (first.position / first.position.sum(-1, keepdim=True)).expand_as(first.mixed))
    torch.testing.assert_close(first.content, torch.full_like(first.content, 1 / 20))
    windowed = build(content=False, window_size=3)  # padded windows: masked keys get no weight
    assert torch.isfinite(windowed(torch.randn(2, 3, 64, 80))).all()
    before = training_step(model.float())
    assert all(not torch.equal(p, before[name]) for name, p in model.named_parameters()), 'a parameter got no update'


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
    log_phi = rand.blocks[2].attn.phi.log_position_attention(5, 6, rand.distance_embedding)
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
    model.eval()  # frozen: the position cache serves Φp even with gradients on
    phi = model.blocks[1].attn.phi
    q = torch.empty(1, 4, 20, 8)
    with posattn.cache_positions(model):
        first = phi.logits_bias(q, q, TokenGrid(4, 5), distance_embedding=model.distance_embedding)
        assert phi.logits_bias(q, q, TokenGrid(4, 5), distance_embedding=model.distance_embedding) is first


def test_bad_ablation_options_are_named():
    with pytest.raises(ValueError, match="phi is 'peripheral' or 'none', got 'irpe'"):
        build(phi='irpe')
    with pytest.raises(ValueError, match="unknown stem 'linear'"):
        build(stem='linear')
    with pytest.raises(ValueError, match="with phi='none' there is none"):
        build(phi='none', phi_init='conv')
    with pytest.raises(ValueError, match="with phi='none' there is none"):
        build(phi='none', phi_trainable=False)
    with pytest.raises(ValueError, match="with phi='none' there is nothing to attend by"):
        build(phi='none', content=False)
    with pytest.raises(ValueError, match='needs a Φp that declares one'):
        posattn.Attention(32, 4, phi='peg', content=False)


def test_options_reach_create_model():
    model = posattn.create_model('pervit_tiny', num_classes=3, stem='patch', cpe=False, phi_init='conv')
    assert isinstance(model.stem, PatchStem) and isinstance(model.blocks[0].cpe, NoPosition)
    assert model.blocks[5].attn.phi.init == 'conv'


@needs_openmmlab
def test_options_reach_the_openmmlab_backbone():
    from posattn_openmmlab.backbones import PosattnPerViT
    backbone = PosattnPerViT(phi='none', stem='patch', frozen_stages=1)  # freezing without a distance embedding
    assert isinstance(backbone.model.stem, PatchStem) and not phi_parameters(backbone.model)
    assert backbone(torch.randn(1, 3, 64, 64))[0].shape == (1, 280, 4, 4)


# configs/ablations: each row's config is ../pervit_t_imagenet.py plus exactly its change.
WIDE = dict(embed_dims=(136, 200, 232, 288), depths=(2, 2, 6, 2), num_heads=4, stem_dims=(48, 64, 96, 128))
WIDE_C = dict(WIDE, embed_dims=(140, 204, 236, 292))
ROWS = {
    'pervit-t_components-a_imagenet.py': ({}, 280),
    'pervit-t_components-b_imagenet.py': (dict(phi='none'), 280),
    'pervit-t_components-c_imagenet.py': (dict(content=False, arch=WIDE_C), 292),
    'pervit-t_components-d_imagenet.py': (dict(stem='patch'), 280),
    'pervit-t_components-e_imagenet.py': (dict(cpe=False), 280),
    'pervit-t_components-f_imagenet.py': (dict(phi='none', stem='patch', arch=WIDE), 288),
    'pervit-t_components-g_imagenet.py': (dict(phi='none', cpe=False), 280),
    'pervit-t_components-h_imagenet.py': (dict(stem='patch', cpe=False, arch=WIDE), 288),
    'pervit-t_components-i_imagenet.py': (dict(phi='none', stem='patch', cpe=False, arch=WIDE), 288),
    **{f'pervit-t_init-{init}_imagenet.py': (dict(phi_init=init), 280) for init in ('peripheral', 'conv', 'rand')},
    'pervit-t_design-euc-n-ml_imagenet.py': ({}, 280),
    'pervit-t_design-euc-ml_imagenet.py': (dict(phi_neighbourhood=False), 280),
    'pervit-t_design-euc_imagenet.py': (dict(phi_neighbourhood=False, phi_multi_layer=False), 280),
    'pervit-t_design-lrn-n-ml_imagenet.py': (dict(phi_embedding='lrn'), 280),
    'pervit-t_design-lrn-ml_imagenet.py': (dict(phi_embedding='lrn', phi_neighbourhood=False), 280),
    'pervit-t_design-lrn_imagenet.py': (dict(phi_embedding='lrn', phi_neighbourhood=False, phi_multi_layer=False),
                                        280),
    **{f'pervit-t_init-{init}-frozen_imagenet.py': (dict(phi_init=init, phi_trainable=False), 280)
       for init in ('peripheral', 'conv', 'rand')},
}


SUBSAMPLED = {'pervit-s_imagenet-50pct.py': (0.5, 600, 10), 'pervit-s_imagenet-25pct.py': (0.25, 1200, 20)}


# Supplement Tab. A4: PerViT-M fine-tuned from ImageNet, DeiT's recipes (dataset, classes, optimiser,
# lr, weight decay, epochs, stochastic depth, random erasing).
TRANSFER = {
    'pervit-m_transfer-cifar10.py': ('CIFAR10', 10, 'SGD', 0.01, 1e-4, 1000, 0.0, None),
    'pervit-m_transfer-cifar100.py': ('CIFAR100', 100, 'SGD', 0.01, 1e-4, 1000, 0.0, None),
    'pervit-m_transfer-inat19.py': ('INaturalist2019', 1010, 'AdamW', 7.5e-5, 0.05, 360, 0.1, 0.1),
}


def test_every_ablation_config_is_listed():
    assert sorted(p.name for p in (REPO / 'configs' / 'ablations').glob('*.py')) == sorted([*ROWS, *SUBSAMPLED,
                                                                                          *TRANSFER])


@needs_openmmlab
@pytest.mark.parametrize('name', sorted(TRANSFER))
def test_transfer_config_fine_tunes_pervit_m_with_deits_recipe(name):
    from mmengine.config import Config
    from mmengine.dataset import Compose
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS
    import numpy as np
    import posattn_openmmlab  # noqa: F401
    dataset, classes, optimizer, lr, decay, epochs, drop_path, erasing = TRANSFER[name]
    base = Config.fromfile(REPO / 'configs' / 'pervit_m_imagenet.py').to_dict()
    cfg = Config.fromfile(REPO / 'configs' / 'ablations' / name).to_dict()
    # the recipe and model of PerViT-M but for what a fine-tune changes
    unchanged = {'default_scope', 'default_hooks', 'env_cfg', 'randomness', 'val_cfg', 'test_cfg', 'val_evaluator',
                 'test_evaluator', 'visualizer', 'log_processor', 'log_level', 'load_from', 'resume'}
    assert all(cfg.get(key) == base.get(key) for key in unchanged)
    assert cfg['model']['backbone'] == dict(base['model']['backbone'], drop_path_rate=drop_path, init_cfg=dict(
        type='Pretrained', checkpoint='checkpoints/pervit_medium.pth'))
    assert cfg['model']['head'] == dict(base['model']['head'], num_classes=classes)
    assert cfg['model']['train_cfg'] == base['model']['train_cfg']  # Mixup 0.8, CutMix 1.0
    assert cfg['data_preprocessor']['num_classes'] == classes
    train, val = cfg['train_dataloader'], cfg['val_dataloader']
    assert train['dataset']['type'] == val['dataset']['type'] == dataset
    assert train['sampler'] == base['train_dataloader']['sampler']  # repeated augmentation
    assert train['batch_size'] * 8 == cfg['auto_scale_lr']['base_batch_size'] == 768
    erasers = [t for t in train['dataset']['pipeline'] if t['type'] == 'RandomErasing']
    assert [t['erase_prob'] for t in erasers] == ([] if erasing is None else [erasing])
    assert {t['type'] for t in train['dataset']['pipeline']} >= {'RandomResizedCrop', 'RandAugment', 'PackInputs'}
    chosen = cfg['optim_wrapper']['optimizer']
    assert (chosen['type'], chosen['lr'], chosen['weight_decay']) == (optimizer, lr, decay)
    assert cfg['train_cfg']['max_epochs'] == epochs == cfg['param_scheduler'][1]['end']
    assert cfg['param_scheduler'][0]['start_factor'] * lr == pytest.approx(1e-6)  # warm-up from 1e-6
    # the pipelines on an image of the dataset's kind: CIFAR's in-memory RGB arrays, iNat's files
    init_default_scope('mmpretrain')
    if dataset.startswith('CIFAR'):
        image = dict(img=np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8), gt_label=3)
        for pipeline in (train['dataset']['pipeline'], val['dataset']['pipeline']):
            assert Compose(pipeline)(dict(image))['inputs'].shape == (3, 224, 224)
    model_cfg = dict(cfg['model'], data_preprocessor=cfg['data_preprocessor'])
    model_cfg['backbone'] = dict(model_cfg['backbone'], init_cfg=None)  # no checkpoint here
    pervit_m = MODELS.build(model_cfg)  # the paper's PerViT-M, 43,723,168 parameters with 1000 classes
    assert sum(p.numel() for p in pervit_m.parameters()) == 43_723_168 + 685 * (classes - 1000)
    model_cfg['backbone'] = dict(model_cfg['backbone'], arch='tiny')  # a training step on a small one
    model_cfg['head'] = dict(model_cfg['head'], in_channels=280)
    model = MODELS.build(model_cfg)
    model.init_weights()
    batch = model.data_preprocessor(dict(inputs=[torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8)] * 2,
                                         data_samples=[labelled_sample(label) for label in (0, classes - 1)]), True)
    losses = model(**batch, mode='loss')
    assert torch.isfinite(sum(losses.values()))


def labelled_sample(label):
    from mmpretrain.structures import DataSample
    return DataSample().set_gt_label(label)


@needs_openmmlab
def test_inaturalist_2019_reads_the_published_layout(tmp_path):
    import json
    from mmengine.registry import init_default_scope
    from PIL import Image
    from posattn_openmmlab.datasets import INaturalist2019
    init_default_scope('mmpretrain')
    categories = [dict(id=i, name=f'species {i}', kingdom='Plantae') for i in (2, 0, 1)]
    images, annotations = [], []
    for image_id, category in enumerate([0, 2, 1, 2]):
        file_name = f'train_val2019/Plants/{category}/{image_id:04x}.jpg'
        (tmp_path / file_name).parent.mkdir(parents=True, exist_ok=True)
        Image.new('RGB', (40, 30), (image_id * 40, 0, 0)).save(tmp_path / file_name)
        images.append(dict(id=100 + image_id, file_name=file_name, width=40, height=30))
        annotations.append(dict(id=image_id, image_id=100 + image_id, category_id=category))
    (tmp_path / 'val2019.json').write_text(json.dumps(dict(images=images, annotations=annotations,
                                                           categories=categories)))
    dataset = INaturalist2019(str(tmp_path), split='val', pipeline=[dict(type='LoadImageFromFile'),
                                                                    dict(type='PackInputs')])
    assert len(dataset) == 4 and dataset.metainfo['classes'] == ('species 0', 'species 1', 'species 2')
    assert list(dataset.get_gt_labels()) == [0, 2, 1, 2]
    item = dataset[1]
    assert item['inputs'].shape == (3, 30, 40) and item['inputs'][2, 0, 0] == 40  # BGR: red last
    with pytest.raises(FileNotFoundError, match='iNaturalist 2019 train annotations not found'):
        INaturalist2019(str(tmp_path), split='train')
    with pytest.raises(ValueError, match="split must be one of \\('train', 'val'\\)"):
        INaturalist2019(str(tmp_path), split='test')
    (tmp_path / 'val2019.json').write_text(json.dumps(dict(images=images, annotations=annotations[:3],
                                                           categories=categories)))
    with pytest.raises(ValueError, match='1 images have no annotation'):
        INaturalist2019(str(tmp_path), split='val')


@needs_openmmlab
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


@needs_openmmlab
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
    with torch.no_grad(), posattn.cache_positions(backbone):
        backbone(images)  # fills the Φp cache
        with FlopCounterMode(display=False) as counter:
            backbone(images)
    return counter.get_total_flops() / 2 / 1e9


@needs_openmmlab
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
    if 'arch' in change:  # widened to the paper's FLOPs (its footnote: comparable to the others)
        target = 1.55 if change.get('content') is False else 1.5  # (c): PerViT-T's own 1.55, "1.6"
        assert abs(paper_gmac(backbone) - target) < 0.015
    samples = [DataSample().set_gt_label(label) for label in (1, 7)]
    losses = model(torch.randn(2, 3, 64, 64), samples, mode='loss')
    sum(losses.values()).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
