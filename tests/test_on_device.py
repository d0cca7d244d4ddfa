"""Checks on ``pytest --device`` (conftest.py) of what other files test on the CPU alone: every Φp's
gradients, PEG against its float64 reference, PerViT-T's parity with the release, and swapped timm /
torchvision models that keep the original's outputs (rpb's and alibi's layers against their float64
references take ``device`` in tests/test_rpb.py and tests/test_alibi.py).

The models and layers run on the device; the references on the CPU, in float64 where the check is
against a float64 formula. With the default ``--device cpu`` these run on the CPU like the rest,
but for the release parity, which would repeat test_convert.py's check as it is.
"""
import pytest
import torch

import posattn
from posattn import Attention
from posattn.convert import pervit_from_release

from conftest import assert_swap_keeps_outputs, gradcheck_layer, randomised, to_cpu
from release_fixtures import pervit_fixture
from test_convert import assert_parity, at_tokens, posattn_outputs
from test_peg import naive_peg


@pytest.mark.parametrize('phi', posattn.list_phis())
def test_every_phi_passes_gradcheck(phi, device):
    """Gradients of the input and of every parameter of the layer with each registered Φp, its
    parameters random, on a 2 x 3 grid with a class token (float64)."""
    layer = randomised(Attention(8, 2, phi=phi, num_prefix_tokens=1).double()).to(device)
    assert gradcheck_layer(layer, torch.randn(2, 7, 8, dtype=torch.float64).to(device), (2, 3))


def test_peg_layer_is_plain_attention_after_the_depthwise_convolution(device):
    """PEG as the layer's token hook: plain attention over the tokens that the naive 3 x 3
    depthwise convolution (plus the residual) has mixed, on a 3 x 4 grid with a class token; float64."""
    layer = randomised(Attention(8, 2, phi='peg', num_prefix_tokens=1).double())
    plain = Attention(8, 2, num_prefix_tokens=1).double()
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith('phi.')})
    x = torch.randn(2, 13, 8, dtype=torch.float64)
    with torch.no_grad():
        expected = plain(naive_peg(x, layer.phi.proj.weight, layer.phi.proj.bias, 3, 4, 1, True), (3, 4))
        out = layer.to(device)(x.to(device), (3, 4))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-10, atol=1e-12)


def test_pervit_tiny_matches_the_release(device):
    """Logits, every block's output and every layer's Φp of PerViT-T with the release's seed-7
    weights, against the release's own float32 outputs (the trimmed fixture of every clone), to the
    fixture's bounds."""
    if device.type == 'cpu':
        pytest.skip('on the CPU this is test_convert.py::test_tiny_matches_release_fixture[trimmed]')
    fixture = pervit_fixture('trimmed')
    model = posattn.create_model('pervit_tiny')
    model.load_state_dict(pervit_from_release(fixture['weights']), strict=True)
    outputs = to_cpu(posattn_outputs(model.to(device), fixture['input'].to(device)))
    assert_parity(at_tokens(outputs, fixture['tokens']), {k: fixture[k] for k in ('logits', 'block_out', 'phi_p')})


def swap_family(name):
    """(model, input, atol) of a family of test_swap.py, test_swap_timm_relative.py or
    test_swap_windows.py (imported here, so that a missing timm or torchvision skips this test only)."""
    if name == 'timm ViT':
        from test_swap import small_timm_vit
        return small_timm_vit(), torch.randn(2, 3, 32, 32), 1e-5
    if name in ('eva02', 'beit'):
        from test_swap_timm_relative import MODELS, image
        return MODELS[name]().double(), image(name, dtype=torch.float64), 1e-10  # the same sums in another order
    from test_swap_windows import CASES
    build, x, _, _ = CASES[name]
    return build(), x, 1e-5


@pytest.mark.parametrize('phi', ['none', 'rpb'])
@pytest.mark.parametrize('name', ['timm ViT', 'eva02', 'beit', 'timm, 14 x 10 map, padded windows',
                                  'torchvision, 16 x 16 map'])
def test_swapped_models_keep_the_original_outputs(name, phi, device):
    """timm's ViT, Eva (RoPE), Beit (its relative position tables) and Swin (timm's with padded
    windows, torchvision's) keep their outputs, in eval and train mode, with 'none' swapped in, and
    with rpb, whose table starts at zero."""
    model, x, atol = swap_family(name)
    assert_swap_keeps_outputs(model, x, atol=atol, device=device, phi=phi)
