"""posattn in OpenMMLab (mmengine / mmpretrain / mmdet / mmseg): import this module once.

``custom_imports = dict(imports=['posattn_openmmlab'], allow_failed_imports=False)`` in a
config (or importing it in a script) does eight things:

* registers the backbones ``PosattnPerViT`` and ``PosattnViT`` in mmengine's root ``MODELS``
  (:mod:`.backbones`), visible from every toolbox's registry;
* registers the neck ``PosattnSimpleFPN`` (ViTDet's simple feature pyramid) there too (:mod:`.necks`);
* registers ``ParamwiseSummaryOptimWrapperConstructor`` in mmengine's root
  ``OPTIM_WRAPPER_CONSTRUCTORS`` (:mod:`.optim`): mmengine's default constructor, whose log
  states ``paramwise_cfg`` in a few lines instead of one per parameter;
* registers the datasets ``PositionalShapes`` (the embedded set), ``CheckedImageNet``,
  ``INaturalist2019`` and ``SubsampledDataset`` in mmpretrain's ``DATASETS`` (:mod:`.datasets`);
* makes mmengine load local checkpoints weights-only with an allow-list of its own types, so
  resume, ``load_from`` and testing work on torch >= 2.6 (:mod:`.checkpoint`);
* makes mmengine write local files atomically, so a killed run never leaves a truncated
  checkpoint under its final name (:mod:`.atomic`);
* adds the OpenMMLab attention families to :func:`posattn.swap_attention` (every ``swap_*``
  module here) and registers the config wrapper that swaps a backbone's attention;
* registers ``PosattnRunner`` in mmengine's root ``RUNNERS`` (:mod:`.runner`: strict loading,
  resume from the newest complete checkpoint, one training per work_dir, exact resume through
  ``RandomStateHook``, :mod:`.random_state`) and ``SafeCheckpointHook`` in its root ``HOOKS``
  (:mod:`.checkpoint_hook`: old checkpoints removed only after the new one is complete).

The detection and segmentation datasets live in their own modules, imported by the configs that
use them, so that classification needs neither mmdet nor mmseg: :mod:`.detection` registers
``ShapesCocoDataset`` (the embedded dense shapes set, :mod:`.dense_shapes`) and
``CheckedCocoDataset`` in mmdet's ``DATASETS``, :mod:`.segmentation` registers
``ShapesSegDataset`` and ``CheckedADE20KDataset`` in mmseg's.
"""
import importlib
import pkgutil

from .atomic import register_atomic_backend
from .backbones import PosattnPerViT, PosattnViT
from .checkpoint import register_checkpoint_loader
from .checkpoint_hook import SafeCheckpointHook
from .datasets import CheckedImageNet, PositionalShapes
from .necks import PosattnSimpleFPN
from .optim import ParamwiseSummaryOptimWrapperConstructor
from .random_state import RandomStateHook
from .runner import PosattnRunner

register_checkpoint_loader()
register_atomic_backend()

for _module in pkgutil.iter_modules(__path__):
    if _module.name.startswith('swap_'):
        importlib.import_module(f'{__name__}.{_module.name}')

__all__ = ['PosattnPerViT', 'PosattnViT', 'PosattnSimpleFPN', 'ParamwiseSummaryOptimWrapperConstructor',
           'PositionalShapes', 'CheckedImageNet', 'PosattnRunner', 'SafeCheckpointHook', 'RandomStateHook',
           'register_checkpoint_loader', 'register_atomic_backend']
