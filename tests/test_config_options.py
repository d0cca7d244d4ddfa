"""Config overrides checked against what reads them (posattn_openmmlab.config_checks, through
posattn_openmmlab.linked_settings.merge_options, which the tools use): a key that nothing would read
(a misspelt one) is refused by tools/train.py, tools/test.py, tools/analyze.py and
tools/compare_phis.py, naming the nearest key that is read, before anything is built or trained; the
overrides users give keep working on the real configs; and a study row's options reach its runs as
Python values, never parsed as text."""
import argparse
import inspect
import re

import pytest

from conftest import REPO, load_test_tool, require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

import analyze as analyze_tool  # noqa: E402  (tools/, on the path from conftest)
import compare_phis  # noqa: E402
import train as train_tool  # noqa: E402
from _common import load_config  # noqa: E402
import posattn_openmmlab.study.runs as runs_module  # noqa: E402
from posattn_openmmlab.study.runs import StudyRunner  # noqa: E402
from posattn_openmmlab.study.spec import with_options  # noqa: E402
from mmengine.config import Config  # noqa: E402

CONFIGS = REPO / 'configs'
HEADER = 'nothing reads these keys of the overrides, so a run would ignore them (a misspelt key?):'


def loaded(config: str, **options) -> Config:
    """The config as tools/train.py, tools/test.py and tools/analyze.py load it, with ``options`` as
    their ``--cfg-options``."""
    args = argparse.Namespace(config=str(CONFIGS / config), cfg_options=options, launcher='none',
                              partial_load=False, work_dir=None)
    return load_config(args)


# ---------------------------------------------------------------- misspelt keys


@pytest.mark.parametrize('config, options, problem', [
    ('your_data/deit_t_image_folder.py', dict(phii='rope'),
     'phii: the config has no phii, and neither the runner nor the tools read one; did you mean phi?'),
    ('deit_t_none_shapes.py', dict(phii='rope'),  # no top-level phi: the nearest key anywhere
     'phii: the config has no phii, and neither the runner nor the tools read one; did you mean model.backbone.phi?'),
    ('pervit_t_shapes.py', {'model.backbone.drop_path_rat': 0.1},
     'model.backbone.drop_path_rat: model.backbone builds PosattnPerViT, which takes no drop_path_rat; '
     'did you mean model.backbone.drop_path_rate?'),
    ('deit_t_none_shapes.py', {'model.head.num_clases': 3},  # LinearClsHead hands its **kwargs to ClsHead
     'model.head.num_clases: model.head builds LinearClsHead, which takes no num_clases; '
     'did you mean model.head.num_classes?'),
    ('deit_t_none_shapes.py', {'optim_wrapper.optimizer.lrr': 1e-3},
     'optim_wrapper.optimizer.lrr: optim_wrapper.optimizer builds AdamW, which takes no lrr; '
     'did you mean optim_wrapper.optimizer.lr?'),
    ('deit_t_none_shapes.py', {'train_cfg.max_epoch': 1},
     "train_cfg.max_epoch: train_cfg is read by mmengine's EpochBasedTrainLoop, which takes no max_epoch; "
     'did you mean train_cfg.max_epochs?'),
    ('deit_t_none_shapes.py', {'train_dataloader.batch_sizee': 8},
     "train_dataloader.batch_sizee: train_dataloader is read by mmengine's Runner.build_dataloader (torch's "
     'DataLoader), which takes no batch_sizee; did you mean train_dataloader.batch_size?'),
    ('deit_t_none_shapes.py', {'randomness.sed': 1},
     "randomness.sed: randomness is read by mmengine's Runner.set_randomness, which takes no sed; "
     'did you mean randomness.seed?'),
    ('deit_t_none_shapes.py', {'env_cfg.cudnn': True},  # nothing close: what it takes
     "env_cfg.cudnn: env_cfg is read by mmengine's Runner.setup_env, which takes no cudnn; it takes "
     'cudnn_benchmark, dist_cfg, mp_cfg, resource_limit'),
    ('deit_t_none_shapes.py', {'default_hooks.loger.interval': 5},
     "default_hooks.loger: the config has no hook loger, and mmengine's default hooks are runtime_info, timer, "
     'sampler_seed, logger, param_scheduler, checkpoint (a hook of your own is dict(type=...)); '
     'did you mean default_hooks.logger?'),
    ('deit_t_none_shapes.py', {'train_dataloader.sampler.shufle': False},
     'train_dataloader.sampler.shufle: train_dataloader.sampler builds DefaultSampler, which takes no shufle; '
     'did you mean train_dataloader.sampler.shuffle?'),
    ('mask-rcnn_pervit-t_shapes.py', {'model.roi_head.bbox_head.num_clases': 3},  # mmdet's registries
     'model.roi_head.bbox_head.num_clases: model.roi_head.bbox_head builds Shared2FCBBoxHead, which takes no '
     'num_clases; did you mean model.roi_head.bbox_head.num_classes?'),
    ('upernet_pervit-t_shapes.py', {'model.decode_head.num_clases': 3},  # mmseg's
     'model.decode_head.num_clases: model.decode_head builds UPerHead, which takes no num_clases; '
     'did you mean model.decode_head.num_classes?'),
])
def test_a_key_that_nothing_reads_is_refused_naming_the_nearest_key(config, options, problem):
    with pytest.raises(ValueError) as refusal:
        loaded(config, **options)
    assert str(refusal.value) == f'{CONFIGS / config}: {HEADER}\n  {problem}'


def test_every_key_nothing_reads_is_named_at_once():
    with pytest.raises(ValueError) as refusal:
        loaded('your_data/deit_t_image_folder.py', phii='rope', num_classes=3, **{'train_cfg.max_epoch': 1})
    lines = str(refusal.value).splitlines()
    assert [line.split(':')[0].strip() for line in lines[1:]] == ['phii', 'train_cfg.max_epoch']


def test_an_override_that_cannot_be_merged_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^train_dataloader.dataset.pipeline.5.scale=64 cannot be merged into the "
                                         r"config: Index 5 exceeds the length of list"):
        loaded('deit_t_none_shapes.py', **{'train_dataloader.dataset.pipeline.5.scale': 64})


@pytest.mark.parametrize('tool', ['train', 'test', 'analyze'])
def test_each_tool_refuses_a_misspelt_key_before_it_builds_anything(tool, tmp_path):
    config = str(CONFIGS / 'your_data' / 'deit_t_image_folder.py')
    argv = {'train': [config, '--work-dir', str(tmp_path)],
            'test': [config, str(tmp_path / 'none.pth'), '--work-dir', str(tmp_path)],
            'analyze': [config, '--out', str(tmp_path)]}[tool] + ['--cfg-options', 'phii=rope']
    main = {'train': train_tool.main, 'test': lambda argv: load_test_tool().main(argv),
            'analyze': analyze_tool.main}[tool]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert str(stop.value).startswith(f'tools/{tool}.py {config}: {config}: {HEADER}')
    assert str(stop.value).endswith('phii: the config has no phii, and neither the runner nor the tools read one; '
                                    'did you mean phi?')
    assert list(tmp_path.iterdir()) == []  # nothing built, nothing written


# ---------------------------------------------------------------- what users set keeps working


COMMON = {  # keys of the configs, and keys new to them that the Runner or a class reads
    'train_dataloader.batch_size': 8, 'optim_wrapper.optimizer.lr': 1e-4, 'randomness.seed': 1,
    'default_hooks.logger.interval': 5, 'default_hooks.checkpoint.max_keep_ckpts': 1,
    'train_dataloader.num_workers': 0, 'train_dataloader.persistent_workers': False,
    'randomness.deterministic': True, 'env_cfg.cudnn_benchmark': True, 'val_cfg.fp16': True,
    'optim_wrapper.clip_grad': dict(max_norm=1.0), 'optim_wrapper.optimizer.betas': (0.9, 0.99),
    'auto_scale_lr.enable': True, 'load_from': 'x.pth', 'resume': True, 'work_dir': 'elsewhere',
    'log_processor.window_size': 5, 'default_hooks.runtime_info': None, 'compile': True,
    'model_wrapper_cfg': dict(type='MMDistributedDataParallel', find_unused_parameters=True),
    'custom_hooks': [dict(type='EMAHook', momentum=1e-4, priority='ABOVE_NORMAL')],
    'model.backbone.init_cfg': None, 'partial_load': True,
}
PER_CONFIG = {
    'deit_t_none_shapes.py': {'train_cfg.max_epochs': 1, 'param_scheduler.1.end': 3,
                              'model.backbone.drop_path_rate': 0.1, 'model.backbone.phi': 'rope',
                              'model.backbone.phi_cfg': dict(frequencies='mixed'),
                              'train_dataloader.dataset.pipeline.0.prob': 0.2, 'model.head.topk': (1, 5)},
    'pervit_t_shapes.py': {'train_cfg.max_epochs': 1, 'model.backbone.drop_path_rate': 0.1,
                           'model.backbone.init_cfg': dict(type='Pretrained', checkpoint='x.pth', prefix='backbone.')},
    'your_data/deit_t_image_folder.py': {'phi': 'rpb', 'num_classes': 3, 'img_size': 64, 'data_root': 'my data',
                                         'warmup_epochs': 1, 'train_cfg.max_epochs': 2,
                                         'train_dataloader.dataset.pipeline.1.scale': 64,
                                         'model.backbone.phi_cfg': dict(table_size=(2, 2))},
    'swap/deit-t_finetune-peg_shapes.py': {'model.backbone.backbone.init_cfg.checkpoint': 'x.pth',
                                           'model.head.init_cfg.checkpoint': 'x.pth', 'train_cfg.max_epochs': 1},
    'mask-rcnn_pervit-t_shapes.py': {'train_cfg.max_iters': 10, 'model.roi_head.bbox_head.num_classes': 3,
                                     'model.test_cfg.rcnn.max_per_img': 10, 'model.backbone.drop_path_rate': 0.2},
    'upernet_pervit-t_shapes.py': {'train_cfg.max_iters': 10, 'model.decode_head.num_classes': 3,
                                   'model.decode_head.norm_cfg.requires_grad': False},
}


@pytest.mark.parametrize('config', sorted(PER_CONFIG))
def test_the_overrides_users_give_are_accepted(config):
    options = dict(COMMON, **PER_CONFIG[config])
    if config.startswith('swap/'):
        del options['model.backbone.init_cfg']  # the swapped backbone's is model.backbone.backbone.init_cfg
    cfg = loaded(config, **options)
    assert cfg.train_dataloader.batch_size == 8 and cfg.randomness.seed == 1
    assert cfg.custom_hooks[0].priority == 'ABOVE_NORMAL' and cfg.optim_wrapper.optimizer.betas == (0.9, 0.99)


@pytest.mark.slow
@pytest.mark.parametrize('config', sorted(str(path.relative_to(CONFIGS)) for path in CONFIGS.rglob('*.py')
                                          if path.parent.name not in ('_base_', 'studies')))
def test_every_key_of_every_config_is_read(config):
    """Each config's own keys, given as overrides of a config that holds none of them, pass the check:
    the rule refuses nothing that the repository's configs set (their top-level helper variables aside)."""
    from posattn_openmmlab.config_checks import option_key_problems
    whole = Config.fromfile(CONFIGS / config).to_dict()
    bare = Config(dict(default_scope=whole.get('default_scope', 'mmengine')))
    assert option_key_problems(bare, whole, known_top_level=whole) == []


def test_the_top_level_keys_the_runner_and_the_tools_read_are_known():
    """Every top-level key that mmengine's Runner, PosattnRunner and the tools read from their config
    (``cfg.get('x')``, ``cfg['x']``) is a top-level key the check accepts."""
    from posattn_openmmlab.linked_settings import TOOL_KEYS
    from mmengine.runner import runner as mmengine_runner
    from posattn_openmmlab.config_checks import RUNNER_KEYS
    from posattn_openmmlab import runner as posattn_runner
    sources = [inspect.getsource(mmengine_runner), inspect.getsource(posattn_runner)]
    sources += [path.read_text() for path in (REPO / 'tools').glob('*.py')]
    read = set()
    for source in sources:
        read.update(re.findall(r"\bcfg\.get\('(\w+)'", source) + re.findall(r"\bcfg\['(\w+)'\]", source))
    assert read and read <= RUNNER_KEYS | set(TOOL_KEYS), sorted(read - RUNNER_KEYS)


# ---------------------------------------------------------------- a study's rows


class TrainingStarted(Exception):
    pass


def test_a_dict_value_is_merged_alike_each_time_it_is_given():
    """mmengine's merge takes ``_delete_`` out of the dicts it merges: every run of a row (one per seed)
    gets the row's options as the study gives them."""
    arch = dict(_delete_=True, embed_dims=[16, 24], depths=[1, 2], num_heads=2, stem_dims=[4, 4, 4, 8])
    options = {'model': dict(backbone=dict(arch=arch))}
    cfg = Config.fromfile(CONFIGS / 'pervit_t_shapes.py')
    first, second = with_options(cfg, options), with_options(cfg, options)
    assert first.model.backbone.arch == second.model.backbone.arch == {
        key: value for key, value in arch.items() if key != '_delete_'}
    assert arch['_delete_'] is True


def test_a_rows_misspelt_option_stops_the_study_before_any_row_trains(tmp_path, monkeypatch):
    (tmp_path / 'study.py').write_text(
        "rows = [dict(name='peripheral', config='your_data/deit_t_image_folder.py'),\n"
        "        dict(name='rope', config='your_data/deit_t_image_folder.py', options=dict(phii='rope'))]\n")
    (tmp_path / 'data' / 'mydata').mkdir(parents=True)  # the configs' data_root, read from here
    monkeypatch.chdir(tmp_path)

    def run(*args):
        raise TrainingStarted(args)
    monkeypatch.setattr(StudyRunner, 'run', run)
    with pytest.raises(SystemExit) as stop:
        compare_phis.main(['--study', str(tmp_path / 'study.py'), '--work-dir', str(tmp_path / 'runs'),
                           '--no-timing'])
    config = CONFIGS / 'your_data' / 'deit_t_image_folder.py'
    assert str(stop.value) == (f'study: the study cannot run as it is; nothing was trained:\n  row rope '
                               f'(your_data/deit_t_image_folder.py): {config}: {HEADER}\n  phii: the config has no '
                               'phii, and neither the runner nor the tools read one; did you mean phi?')
    assert not (tmp_path / 'runs' / 'peripheral' / 'seed0').exists()


@pytest.mark.parametrize('options, key, value', [
    ({'phi': 'rpb', 'model.backbone.phi_cfg': dict(table_size=(2, 2))}, 'model.backbone.phi_cfg',
     dict(table_size=(2, 2))),
    (dict(data_root='my data'), 'val_dataloader.dataset.data_root', 'my data'),
    ({'optim_wrapper.optimizer.betas': (0.9, 0.95)}, 'optim_wrapper.optimizer.betas', (0.9, 0.95)),
])
def test_a_rows_options_reach_its_runs_as_python_values(tmp_path, monkeypatch, options, key, value):
    """A dict, a string with spaces and a tuple keep their value in the config the run trains, which
    tools/train.py reads without --cfg-options."""
    (tmp_path / 'study.py').write_text(f"rows = [dict(name='mine', config='your_data/deit_t_image_folder.py', "
                                       f"options={options!r})]\n")
    commands = []

    class Popen:
        def __init__(self, command, **kwargs):
            commands.append(command)
            raise TrainingStarted()
    monkeypatch.setattr(runs_module.subprocess, 'Popen', Popen)
    (tmp_path / 'data' / 'mydata').mkdir(parents=True)  # the configs' data_root, read from here
    (tmp_path / 'my data').mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TrainingStarted):
        compare_phis.main(['--study', str(tmp_path / 'study.py'), '--work-dir', str(tmp_path / 'runs'), '--no-timing',
                           '--cfg-options', 'num_classes=3'])
    (command,) = commands
    run_dir = tmp_path / 'runs' / 'mine' / 'seed0'
    assert command[1:] == [str(REPO / 'tools' / 'train.py'), str(run_dir / 'config.py'), '--work-dir', str(run_dir)]
    trained = Config.fromfile(run_dir / 'config.py')
    trained_value = trained
    for part in key.split('.'):
        trained_value = trained_value[part]
    if key.endswith('data_root'):
        value = str(tmp_path / value)  # read from the folder the command runs in, as tools/train.py reads it
    assert trained_value == value  # a tuple is no list, nor a dict a string
    assert trained.model.head.num_classes == trained.data_preprocessor.num_classes == 3  # linked keys, as before
    assert trained.randomness.seed == 0


def test_the_schedulers_that_ended_with_the_run_follow_its_new_length():
    """A shorter run keeps its cosine decay whole: the schedulers that ended where the run did (by
    what they are, not by their place in the list) end where it now does, unless set themselves."""
    from posattn_openmmlab.linked_settings import merge_options
    config = CONFIGS / 'study' / 'deit-t-half_ape_shapes.py'
    cfg = Config.fromfile(config)
    assert [scheduler['end'] for scheduler in cfg.param_scheduler] == [1, 10]
    merge_options(cfg, {'train_cfg.max_epochs': 3})
    assert [scheduler['end'] for scheduler in cfg.param_scheduler] == [1, 3]
    cfg = Config.fromfile(config)
    merge_options(cfg, {'train_cfg.max_epochs': 3, 'param_scheduler.1.end': 7})
    assert [scheduler['end'] for scheduler in cfg.param_scheduler] == [1, 7]
    cfg = Config.fromfile(config)
    merge_options(cfg, {'train_cfg.max_epochs': 1})  # as long as the warmup: the decay never starts
    assert [(scheduler.get('begin', 0), scheduler['end']) for scheduler in cfg.param_scheduler] == [(0, 1), (1, 10)]
