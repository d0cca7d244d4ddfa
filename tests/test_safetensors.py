"""safetensors files (timm's weights as timm ships them) wherever posattn takes a checkpoint path:
``read_checkpoint`` tells them from PyTorch files by their content, honours ``map_location``,
returns tensors that own their memory, and names what is wrong with a damaged file."""
import json
import sys

import pytest
import torch

import posattn
from posattn.convert import read_checkpoint

safetensors_torch = pytest.importorskip('safetensors.torch')
timm = pytest.importorskip('timm')


@pytest.fixture(scope='module')
def deit_weights():
    torch.manual_seed(0)
    return timm.create_model('deit_tiny_patch16_224', pretrained=False).state_dict()


@pytest.fixture
def small_file(tmp_path):
    """(path, tensors) of a small safetensors file with metadata."""
    tensors = {'weight': torch.randn(3, 4), 'steps': torch.arange(5), 'half': torch.randn(2).half()}
    path = tmp_path / 'small.safetensors'
    safetensors_torch.save_file(tensors, path, metadata={'format': 'pt'})
    return path, tensors


def assert_same(got, expected):
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_read_checkpoint_reads_a_timm_vit_saved_as_safetensors(tmp_path, deit_weights):
    path = tmp_path / 'deit_tiny.safetensors'
    safetensors_torch.save_file(deit_weights, path)
    assert_same(read_checkpoint(path), deit_weights)


def test_create_model_loads_timm_weights_from_safetensors(tmp_path, deit_weights, recwarn):
    path = tmp_path / 'deit_tiny.safetensors'
    safetensors_torch.save_file(deit_weights, path)
    model = posattn.create_model('vit_tiny', checkpoint=path)
    assert_same(model.state_dict(), deit_weights)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]
    with pytest.warns(UserWarning, match=r'vit_tiny from checkpoint .*deit_tiny.safetensors \(posattn layout\): '
                                         r'84 Φp keys are not in it'):
        peripheral = posattn.create_model('vit_tiny', phi='peripheral', checkpoint=str(path))
    assert torch.equal(peripheral.blocks[7].attn.qkv.weight, deit_weights['blocks.7.attn.qkv.weight'])


def test_the_format_is_told_by_content_not_by_name(tmp_path):
    weights = posattn.create_model('pervit_tiny', num_classes=10).state_dict()
    unnamed = tmp_path / 'pervit_tiny.bin'
    safetensors_torch.save_file(weights, unnamed)
    assert_same(posattn.create_model('pervit_tiny', num_classes=10, checkpoint=unnamed).state_dict(), weights)
    misnamed = tmp_path / 'pervit_tiny.safetensors'  # a torch.save file under a safetensors name
    torch.save(weights, misnamed)
    assert_same(read_checkpoint(misnamed), weights)


def test_pytorch_files_read_as_before(tmp_path, small_file):
    """torch.save's zip files and the older bare pickles (whose first byte, 0x80, a safetensors
    header length may share) still go to torch.load, with torch's map_location semantics."""
    _, tensors = small_file
    for zipped in (True, False):
        path = tmp_path / f'zipped_{zipped}.pth'
        torch.save(tensors, path, _use_new_zipfile_serialization=zipped)
        assert_same(read_checkpoint(path), tensors)
        assert_same(read_checkpoint(path, map_location=lambda storage, location: storage), tensors)
        assert_same(read_checkpoint(path, map_location={'cpu': 'cpu'}), tensors)


@pytest.mark.parametrize('map_location', [None, 'cpu', torch.device('cpu'), {'cpu': 'cpu'}, {'cuda:0': 'cpu'}])
def test_map_location_to_the_cpu(small_file, map_location):
    path, tensors = small_file
    loaded = read_checkpoint(path, map_location=map_location)
    assert_same(loaded, tensors)
    assert all(value.device.type == 'cpu' for value in loaded.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a GPU')
@pytest.mark.parametrize('map_location', ['cuda', 'cuda:0', torch.device('cuda', 0), {'cpu': 'cuda:0'}])
def test_map_location_to_a_gpu(small_file, map_location):
    path, tensors = small_file
    loaded = read_checkpoint(path, map_location=map_location)
    assert all(value.device == torch.device('cuda', 0) for value in loaded.values())
    assert_same({key: value.cpu() for key, value in loaded.items()}, tensors)


def test_map_location_that_is_not_a_device_is_refused(small_file):
    path, _ = small_file
    with pytest.raises(TypeError, match=r'small.safetensors is a safetensors file: map_location may be a device '
                                        r'\(a string or torch.device\), a dict mapping "cpu" to one, or None \(CPU\); '
                                        r'a function of \(storage, location\) only applies to PyTorch checkpoints'):
        read_checkpoint(path, map_location=lambda storage, location: storage)
    with pytest.raises(ValueError, match=r"map_location='gpu0' is not a device, reading .*small.safetensors"):
        read_checkpoint(path, map_location='gpu0')


def test_tensors_do_not_change_when_the_file_is_rewritten_in_place(small_file):
    path, tensors = small_file
    loaded = read_checkpoint(path)
    with open(path, 'r+b') as f:  # as torch.save to the same path would: same file, new bytes
        f.seek(path.stat().st_size - 64)
        f.write(bytes(64))
    assert_same(loaded, tensors)


def test_a_truncated_safetensors_file_says_so(tmp_path, deit_weights):
    path = tmp_path / 'deit_tiny.safetensors'
    safetensors_torch.save_file(deit_weights, path)
    content = path.read_bytes()
    header_end = 8 + int.from_bytes(content[:8], 'little')
    data = len(content) - header_end
    path.write_bytes(content[:100_000])
    with pytest.raises(ValueError, match=rf'deit_tiny.safetensors is a truncated safetensors file \(100000 bytes\): '
                                         rf'its header describes {data} bytes of tensor data, the file holds '
                                         rf'{100_000 - header_end}$'):
        posattn.create_model('vit_tiny', checkpoint=path)
    path.write_bytes(content[:100])
    with pytest.raises(ValueError, match=rf'is a truncated safetensors file \(100 bytes\): its header alone takes '
                                         rf'{header_end} bytes$'):
        read_checkpoint(path)
    path.write_bytes(content[:6])
    with pytest.raises(ValueError, match=r'deit_tiny.safetensors is not a safetensors file \(6 bytes starting .*\): '
                                         r'one starts with an 8-byte header length and a JSON header \("\{"\); '
                                         r'perhaps a truncated copy or download$'):
        read_checkpoint(path)
    path.write_bytes(b'')
    with pytest.raises(ValueError, match=r'is empty \(0 bytes\)'):
        read_checkpoint(path)


def test_a_damaged_safetensors_file_says_so(tmp_path, small_file):
    path, _ = small_file
    content = path.read_bytes()
    header_size = int.from_bytes(content[:8], 'little')
    broken = tmp_path / 'broken.safetensors'
    broken.write_bytes(content[:8] + b'{' + b' ' * (header_size - 1) + content[8 + header_size:])
    with pytest.raises(ValueError, match=r'broken.safetensors is a damaged safetensors file \(\d+ bytes\): its header '
                                         r'is not a table of tensors: JSONDecodeError'):
        read_checkpoint(broken)
    header = json.dumps({'weight': {'dtype': 'F32', 'shape': [2]}}).encode()
    broken.write_bytes(len(header).to_bytes(8, 'little') + header + bytes(8))
    with pytest.raises(ValueError, match=r"its header is not a table of tensors: KeyError: 'data_offsets'"):
        read_checkpoint(broken)
    broken.write_bytes(content + b'extra')
    with pytest.raises(ValueError, match=r'broken.safetensors could not be read as a safetensors file '
                                         r'\(\d+ bytes, onto cpu\): .*not fully covered'):
        read_checkpoint(broken)


def test_reading_without_the_safetensors_package_says_how_to_install_it(monkeypatch, small_file):
    path, _ = small_file
    monkeypatch.setitem(sys.modules, 'safetensors', None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, 'safetensors.torch', None)
    with pytest.raises(ImportError, match=r'small.safetensors is a safetensors file; reading it needs the '
                                          r'safetensors package: pip install safetensors$'):
        read_checkpoint(path)
