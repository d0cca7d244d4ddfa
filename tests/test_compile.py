"""torch.compile of a training step with ``fullgraph=True``: no graph break in any model (PerViT-T, the
ViT with each Φp, the windowed dense backbone, swapped timm ViT and Swin), the same loss and
gradients as eager; inference inside posattn.cache_positions likewise; and Inductor's compiled step on
one small model."""
import pytest
import torch

import posattn

timm = pytest.importorskip('timm')


def small_models():
    models = {
        'pervit_tiny': lambda: posattn.create_model('pervit_tiny', num_classes=5),
        'dense_pervit_tiny': lambda: posattn.create_model('pervit_tiny', num_classes=5, window_size=4,
                                                          global_blocks=(3, 7, 11)),
        'swapped_timm_vit': lambda: posattn.swap_attention(
            timm.create_model('vit_tiny_patch16_224', img_size=64, depth=2, num_classes=5), phi='peripheral'),
        'swapped_timm_swin': lambda: posattn.swap_attention(
            timm.create_model('swin_tiny_patch4_window7_224', img_size=64, window_size=4, embed_dim=32,
                              depths=(2, 2), num_heads=(2, 4), num_classes=5, drop_path_rate=0.0), phi='irpe'),
    }
    for phi in posattn.list_phis():
        models[f'vit_tiny_{phi}'] = lambda phi=phi: posattn.create_model('vit_tiny', phi=phi, depth=2, num_classes=5)
    return models


MODELS = small_models()


def loss_and_gradients(model, x):
    model.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize('name', list(MODELS))
def test_training_step_compiles_as_one_graph(name):
    """Dynamo traces forward and backward whole (``fullgraph=True`` raises at any graph break); the
    traced step gives eager's loss and gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[name]().train()
    x = torch.randn(2, 3, 96 if name == 'dense_pervit_tiny' else 64, 64)
    expected = loss_and_gradients(model, x)
    compiled = torch.compile(model, backend='eager', fullgraph=True)
    loss, grads = loss_and_gradients(compiled, x)
    torch.testing.assert_close(loss, expected[0], rtol=1e-6, atol=1e-7)
    for got, want in zip(grads, expected[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_inductor_training_step_matches_eager():
    """Inductor's generated kernels (C++ on the CPU) for the ViT with the peripheral Φp."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = posattn.create_model('vit_tiny', phi='peripheral', depth=2, num_classes=5).train()
    x = torch.randn(2, 3, 64, 64)
    expected = loss_and_gradients(model, x)
    loss, grads = loss_and_gradients(torch.compile(model, fullgraph=True), x)
    torch.testing.assert_close(loss, expected[0], rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected[1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('name', ['pervit_tiny'] + [name for name in MODELS if name.startswith('vit_tiny_')])
def test_inference_inside_the_position_cache_compiles_as_one_graph(name):
    torch._dynamo.reset()
    model = MODELS[name]().eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), posattn.cache_positions(model):
        expected = model(x)
        compiled = torch.compile(model, backend='eager', fullgraph=True)
        torch.testing.assert_close(compiled(x), expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(compiled(x), expected, rtol=1e-6, atol=1e-6)  # the cache filled
