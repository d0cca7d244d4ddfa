"""The OpenMMLab stack itself: compiled mmcv ops, the toolboxes, and checkpoint loading on torch >= 2.6."""
import argparse
import pickle

import pytest
import torch

from mmengine.logging import HistoryBuffer, MessageHub
from mmengine.runner import CheckpointLoader

from posattn_openmmlab.checkpoint import history_buffer_method, load_local_checkpoint


def test_mmcv_compiled_ops_run():
    import mmcv.ops
    boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 10., 10.], [50., 50., 60., 60.]])
    scores = torch.tensor([0.9, 0.8, 0.7])
    dets, keep = mmcv.ops.nms(boxes, scores, iou_threshold=0.5)
    assert keep.tolist() == [0, 2]
    assert dets[:, 4].tolist() == pytest.approx([0.9, 0.7])


def test_toolboxes_import_with_their_pinned_versions():
    import mmcv
    import mmdet.models  # noqa: F401  (needs mmcv._ext)
    import mmengine
    import mmpretrain.models  # noqa: F401
    import mmseg.models  # noqa: F401
    assert (mmengine.__version__, mmcv.__version__) == ('0.10.7', '2.1.0')


def test_mmengine_style_checkpoint_loads_weights_only(tmp_path):
    import posattn_openmmlab  # noqa: F401  (registers the loader)
    hub = MessageHub.get_instance('test_checkpoint_round_trip')
    hub.update_scalar('train/loss', 1.5)
    hub.update_scalar('train/loss', 0.5)
    path = tmp_path / 'epoch_1.pth'
    torch.save({'meta': {'epoch': 1, 'iter': 2}, 'state_dict': {'w': torch.ones(2)},
                'message_hub': hub.state_dict(), 'args': argparse.Namespace(lr=0.1)}, path)
    loaded = CheckpointLoader.load_checkpoint(str(path), map_location='cpu')
    buffer = loaded['message_hub']['log_scalars']['train/loss']
    assert isinstance(buffer, HistoryBuffer) and buffer.mean() == 1.0 and buffer.min() == 0.5
    assert torch.equal(loaded['state_dict']['w'], torch.ones(2)) and loaded['args'].lr == 0.1


class Untrusted:
    """A class no allow-list names: unpickling it would run the file's choice of code."""


def test_foreign_objects_are_still_refused(tmp_path):
    path = tmp_path / 'foreign.pth'
    torch.save({'state_dict': {}, 'extra': Untrusted()}, path)
    with pytest.raises(pickle.UnpicklingError, match='holds objects that weights-only loading refuses'):
        load_local_checkpoint(str(path))
    with pytest.raises(FileNotFoundError, match='can not be found'):
        load_local_checkpoint(str(tmp_path / 'missing.pth'))


def test_only_history_buffer_statistics_are_looked_up():
    assert history_buffer_method(HistoryBuffer, 'mean') is HistoryBuffer.mean
    with pytest.raises(pickle.UnpicklingError, match=r"refusing getattr\(.*'__init__'\)"):
        history_buffer_method(HistoryBuffer, '__init__')
    with pytest.raises(pickle.UnpicklingError, match='refusing getattr'):
        history_buffer_method(torch, 'load')
