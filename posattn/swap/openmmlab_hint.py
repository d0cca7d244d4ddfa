"""The OpenMMLab families register from ``posattn_openmmlab``: a model of an OpenMMLab package
refused before it is imported is told to import it."""
from typing import Optional, Sequence

from .core import register_refusal_hint

__all__ = []

_PACKAGES = ('mmpretrain.', 'mmseg.', 'mmdet.', 'mmcv.')


def _import_posattn_openmmlab(classes: Sequence[str]) -> Optional[str]:
    if not any(name.startswith(_PACKAGES) for name in classes):
        return None
    return ("import posattn_openmmlab, which adds mmpretrain's and mmseg's VisionTransformer and mmdet's "
            'SwinTransformer')


register_refusal_hint(_import_posattn_openmmlab)
