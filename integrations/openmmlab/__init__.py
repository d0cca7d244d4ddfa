"""posattn in OpenMMLab (mmengine / mmpretrain / mmdet / mmseg): import this module once.

``custom_imports = dict(imports=['posattn_openmmlab'], allow_failed_imports=False)`` in a
config (or importing it in a script) registers posattn's names in the OpenMMLab registries and
changes nothing else outside posattn: mmengine's checkpoint loader and file backends, mmcv's ops
and timm's models stay as they were. It

* registers the backbones ``PosattnPerViT`` and ``PosattnViT`` in mmengine's root ``MODELS``
  (:mod:`.backbones`), visible from every toolbox's registry;
* registers the neck ``PosattnSimpleFPN`` (ViTDet's simple feature pyramid) there too (:mod:`.necks`);
* registers ``ParamwiseSummaryOptimWrapperConstructor`` in mmengine's root
  ``OPTIM_WRAPPER_CONSTRUCTORS`` (:mod:`.optim`): mmengine's default constructor, whose log
  states ``paramwise_cfg`` in a few lines instead of one per parameter;
* registers ``CosineAfterWarmupLR`` in mmengine's root ``PARAM_SCHEDULERS`` (:mod:`.schedules`): the
  DeiT recipe's cosine decay after its warm-up, left out in a run no longer than the warm-up;
* registers the datasets ``PositionalShapes`` (the embedded set), ``PositionalRelations`` (the
  harder embedded benchmark), ``CheckedImageNet``, ``INaturalist2019`` and ``SubsampledDataset`` in
  mmpretrain's ``DATASETS`` (:mod:`.datasets`);
* adds the OpenMMLab attention families to :func:`posattn.swap_attention` (every ``swap_*``
  module here) and registers the config wrapper that swaps a backbone's attention;
* lets posattn's own checkpoint reader (:func:`posattn.convert.read_checkpoint`) accept the types
  mmengine keeps in its checkpoints (:mod:`.checkpoint`);
* where the installed ``transformers`` lacks names that mmpretrain's multimodal models import
  (transformers 5 with mmpretrain 1.2), imports mmpretrain's models without those, with a warning
  (:mod:`.mmpretrain_multimodal`), so that every other mmpretrain, mmdet and mmseg model builds;
* registers ``PosattnRunner`` in mmengine's root ``RUNNERS`` and ``SafeCheckpointHook``,
  ``RandomStateHook``, ``PositionCacheHook`` and ``EmptyImageCheckHook`` (:mod:`.data_checks`) in
  its root ``HOOKS``.

What posattn changes in the libraries' behaviour, it changes inside its own runner, hooks,
backbones and tools. ``PosattnRunner`` (:mod:`.runner`) loads checkpoints strictly and
weights-only with an allow-list of mmengine's types (:mod:`.checkpoint`, which makes mmengine's
own checkpoints readable on torch >= 2.6), writes them atomically (:mod:`.atomic`), resumes from
the newest complete checkpoint, holds the work_dir's lock from its constructor on
(:mod:`.work_dir_lock`), resumes exactly (:mod:`.random_state`), computes each Φp once per grid
while it validates and tests (:mod:`.position_cache_hook`) and, for the duration of its runs,
routes mmcv's NMS and RoIAlign to torchvision where mmcv has no kernels for the device
(:mod:`.torchvision_ops`). ``SafeCheckpointHook`` (:mod:`.checkpoint_hook`) removes old
checkpoints only after the new one is complete. For scripts of your own,
:func:`~.checkpoint.posattn_checkpoint_loading` (a ``with`` block) reads checkpoints through
mmengine the runner's way, and :func:`~.torchvision_ops.route_mmcv_ops_to_torchvision` routes
mmcv's ops.

The detection and segmentation datasets live in their own modules, imported by the configs that
use them, so that classification needs neither mmdet nor mmseg: :mod:`.detection` registers
``ShapesCocoDataset`` (the embedded dense shapes set, :mod:`.dense_shapes_dataset`) and
``CheckedCocoDataset`` in mmdet's ``DATASETS``, :mod:`.segmentation` registers
``ShapesSegDataset`` and ``CheckedADE20KDataset`` in mmseg's.
"""
import importlib
import pkgutil

try:
    import mmengine  # noqa: F401
except ImportError as error:
    raise ImportError("posattn_openmmlab needs OpenMMLab (mmengine, mmcv, mmpretrain, mmdet, mmseg): install "
                      "posattn's 'mm' extra and mmcv as README.md and docs/openmmlab.md describe") from error

from .mmpretrain_multimodal import import_mmpretrain_beside_transformers

import_mmpretrain_beside_transformers()  # before anything imports mmpretrain's models

from .backbones import PosattnPerViT, PosattnViT  # noqa: E402
from .checkpoint import posattn_checkpoint_loading
from .checkpoint_hook import SafeCheckpointHook
from .datasets import CheckedImageNet, PositionalRelations, PositionalShapes
from .necks import PosattnSimpleFPN
from .optim import ParamwiseSummaryOptimWrapperConstructor
from .position_cache_hook import PositionCacheHook
from .random_state import RandomStateHook
from .runner import PosattnRunner
from .schedules import CosineAfterWarmupLR
from .torchvision_ops import route_mmcv_ops_to_torchvision

for _module in pkgutil.iter_modules(__path__):
    if _module.name.startswith('swap_'):
        importlib.import_module(f'{__name__}.{_module.name}')

__all__ = ['PosattnPerViT', 'PosattnViT', 'PosattnSimpleFPN', 'ParamwiseSummaryOptimWrapperConstructor',
           'CosineAfterWarmupLR', 'PositionalShapes', 'PositionalRelations', 'CheckedImageNet', 'PosattnRunner',
           'SafeCheckpointHook', 'RandomStateHook', 'PositionCacheHook', 'posattn_checkpoint_loading',
           'route_mmcv_ops_to_torchvision']
