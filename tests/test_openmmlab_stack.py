"""The OpenMMLab stack itself: compiled mmcv ops, the toolboxes, and checkpoint loading on torch >= 2.6
(inside posattn_checkpoint_loading only; mmengine's loader is left as it is)."""
import argparse
import pickle
import threading

import pytest
import torch

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from mmengine.logging import HistoryBuffer, MessageHub
from mmengine.runner import CheckpointLoader

from posattn_openmmlab.checkpoint import history_buffer_method, load_local_checkpoint, posattn_checkpoint_loading
from conftest import REPO


def test_mmcv_compiled_ops_run():
    import mmcv.ops
    boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 10., 10.], [50., 50., 60., 60.]])
    scores = torch.tensor([0.9, 0.8, 0.7])
    dets, keep = mmcv.ops.nms(boxes, scores, iou_threshold=0.5)
    assert keep.tolist() == [0, 2]
    assert dets[:, 4].tolist() == pytest.approx([0.9, 0.7])


@pytest.mark.environment
def test_toolboxes_import_with_their_pinned_versions():
    import mmcv
    import mmdet.models  # noqa: F401  (needs mmcv._ext)
    import mmengine
    import mmpretrain.models  # noqa: F401
    import mmseg.models  # noqa: F401
    assert (mmengine.__version__, mmcv.__version__) == ('0.10.7', '2.1.0')


def mmengine_style_checkpoint(path):
    """What mmengine's runner saves: a message hub of HistoryBuffers, numpy arrays; and a Namespace."""
    hub = MessageHub.get_instance('test_checkpoint_round_trip')
    hub.update_scalar('train/loss', 1.5)
    hub.update_scalar('train/loss', 0.5)
    torch.save({'meta': {'epoch': 1, 'iter': 2}, 'state_dict': {'w': torch.ones(2)},
                'message_hub': hub.state_dict(), 'args': argparse.Namespace(lr=0.1)}, path)
    return str(path)


def test_mmengine_style_checkpoint_loads_weights_only_with_posattn_checkpoint_loading(tmp_path):
    path = mmengine_style_checkpoint(tmp_path / 'epoch_1.pth')
    mmengine_loader = CheckpointLoader._schemes['']
    with pytest.raises(pickle.UnpicklingError):  # mmengine's own loader, torch's weights-only default
        CheckpointLoader.load_checkpoint(path, map_location='cpu')
    with posattn_checkpoint_loading():
        loaded = CheckpointLoader.load_checkpoint(path, map_location='cpu')
    buffer = loaded['message_hub']['log_scalars']['train/loss']
    assert isinstance(buffer, HistoryBuffer) and buffer.mean() == 1.0 and buffer.min() == 0.5
    assert torch.equal(loaded['state_dict']['w'], torch.ones(2)) and loaded['args'].lr == 0.1
    assert CheckpointLoader._schemes[''] is mmengine_loader  # the very same loader after the block
    with pytest.raises(pickle.UnpicklingError):
        CheckpointLoader.load_checkpoint(path, map_location='cpu')


def test_posattn_checkpoint_loading_is_for_its_own_thread_and_nests(tmp_path):
    path = mmengine_style_checkpoint(tmp_path / 'epoch_1.pth')
    mmengine_loader = CheckpointLoader._schemes['']

    def load_in_another_thread():
        outcome = []

        def load():
            try:
                outcome.append(CheckpointLoader.load_checkpoint(path, map_location='cpu'))
            except pickle.UnpicklingError as error:
                outcome.append(error)
        thread = threading.Thread(target=load)
        thread.start()
        thread.join()
        return outcome[0]

    with posattn_checkpoint_loading():
        with posattn_checkpoint_loading():
            assert isinstance(load_in_another_thread(), pickle.UnpicklingError)  # mmengine's loader there
        assert CheckpointLoader.load_checkpoint(path, map_location='cpu')['meta']['epoch'] == 1  # still inside
    assert CheckpointLoader._schemes[''] is mmengine_loader

    def theirs(filename, map_location):
        return 'theirs'
    with posattn_checkpoint_loading():  # a loader registered meanwhile stays
        CheckpointLoader.register_scheme(prefixes='', loader=theirs, force=True)
    try:
        assert CheckpointLoader._schemes[''] is theirs
    finally:
        CheckpointLoader.register_scheme(prefixes='', loader=mmengine_loader, force=True)


def test_the_docs_example_loads_a_training_checkpoint_through_mmpretrain(tmp_path):
    """docs/openmmlab.md: mmpretrain's get_model with one of these checkpoints, inside the block."""
    from mmpretrain import get_model
    config = str(REPO / 'configs' / 'pervit_t_shapes.py')
    trained = get_model(config)
    path = mmengine_style_checkpoint(tmp_path / 'epoch_10.pth')
    torch.save(dict(torch.load(path, weights_only=False), state_dict=trained.state_dict()), path)
    with pytest.raises(pickle.UnpicklingError):
        get_model(config, pretrained=path)
    with posattn_checkpoint_loading():
        model = get_model(config, pretrained=path)
    assert all(torch.equal(value, trained.state_dict()[key]) for key, value in model.state_dict().items())


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
