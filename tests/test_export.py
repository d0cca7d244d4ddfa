"""torch.export with dynamic image sizes: one exported program serves sizes it was not traced at,
with the eager model's outputs, for the ViT with every Φp and for PerViT (docs/export.md)."""
import warnings

import pytest
import torch
from torch.export import Dim

import posattn
from conftest import randomise_peripheral, randomised
from posattn.models.pervit import PerViT
from posattn.phi.peripheral import PeripheralPhi
from posattn.phi.peripheral_kernel import _row_chunks


def small_pervit(**kwargs):
    """PerViT's layers (conv stem, CPE, peripheral Φp with a shared distance embedding), small."""
    return PerViT(embed_dims=(32, 48), depths=(1, 1), num_heads=2, stem_dims=(8, 8, 8, 8), num_classes=5, **kwargs)


MODELS = {f'vit_tiny_{phi}': lambda phi=phi: posattn.create_model('vit_tiny', phi=phi, depth=1, num_classes=5)
          for phi in posattn.list_phis()}
MODELS['pervit'] = small_pervit


def export_dynamic(model, example, multiple=16, strict=False):
    """``model`` exported with its input's batch, height and width dynamic: 1 to 64 images, each side
    ``multiple`` pixels times 2 to 32."""
    batch, height, width = Dim('batch', min=1, max=64), Dim('height', min=2, max=32), Dim('width', min=2, max=32)
    return torch.export.export(model, (example,), strict=strict,
                               dynamic_shapes=({0: batch, 2: multiple * height, 3: multiple * width},))


def assert_exported_matches_eager(exported, model, sizes):
    """The program's outputs are the model's for (batch, height, width) ``sizes``."""
    for batch, height, width in sizes:
        x = torch.randn(batch, 3, height, width)
        with torch.no_grad():
            expected = model(x)
        torch.testing.assert_close(exported.module()(x), expected)


@pytest.mark.parametrize('name', list(MODELS))
def test_one_program_serves_sizes_it_was_not_traced_at(name):
    model = randomised(MODELS[name]())
    exported = export_dynamic(model, torch.randn(2, 3, 64, 80))
    assert_exported_matches_eager(exported, model, [(1, 48, 96), (3, 128, 64), (1, 224, 224)])


class LogPositionAttention(torch.nn.Module):
    """log Φp of a peripheral Φp on the grid of a (B, C, H, W) map."""

    def __init__(self):
        super().__init__()
        self.phi = randomise_peripheral(PeripheralPhi(num_heads=3), seed=0)

    def forward(self, feature_map):
        return self.phi.log_position_attention(feature_map.shape[-2], feature_map.shape[-1])


def test_the_exported_peripheral_phi_equals_its_chunked_eager_computation():
    """Exported, log Φp is computed for all queries at once; eagerly, a 20 x 21 grid runs in chunks of queries."""
    module = LogPositionAttention()
    height, width = Dim('height', min=2, max=32), Dim('width', min=2, max=32)
    exported = torch.export.export(module, (torch.zeros(1, 1, 4, 5),), dynamic_shapes=({2: height, 3: width},))
    assert len(_row_chunks(torch.zeros(2 * 20 + 1, 2 * 21 + 1, 12), 20, 21)) > 1
    for grid in [(20, 21), (3, 7)]:
        with torch.no_grad():
            torch.testing.assert_close(exported.module()(torch.zeros(1, 1, *grid)), module(torch.zeros(1, 1, *grid)))


@pytest.mark.slow
def test_strict_export_under_no_grad():
    model = randomised(posattn.create_model('vit_tiny', phi='peripheral', depth=1, num_classes=5))
    with torch.no_grad():
        exported = export_dynamic(model, torch.randn(2, 3, 64, 80), strict=True)
    assert_exported_matches_eager(exported, model, [(1, 48, 96), (3, 128, 64)])


@pytest.mark.slow
def test_windowed_pervit_exports_grids_that_its_windows_tile():
    model = randomised(small_pervit(window_size=2, global_blocks=(1,)))
    exported = export_dynamic(model, torch.randn(2, 3, 64, 96), multiple=32)  # 16-pixel patches, 2 x 2 windows
    assert_exported_matches_eager(exported, model, [(1, 96, 64), (3, 128, 128)])


@pytest.mark.slow
def test_pervit_tiny_exports_with_dynamic_sizes():
    model = randomised(posattn.create_model('pervit_tiny'))
    exported = export_dynamic(model, torch.randn(2, 3, 64, 80))
    assert_exported_matches_eager(exported, model, [(1, 48, 96), (3, 112, 64)])


@pytest.mark.parametrize('phi', ['peripheral', 'irpe'])
def test_a_swapped_timm_vit_exports_for_any_size(phi):
    """The swapped model's grid is read from the patch projection as symbolic sizes under export."""
    timm = pytest.importorskip('timm')
    torch.manual_seed(0)
    model = timm.create_model('deit_tiny_patch16_224', pretrained=False, img_size=64, depth=1, num_classes=5,
                              dynamic_img_size=True)
    model = randomised(posattn.swap_attention(model, phi=phi).eval())
    exported = export_dynamic(model, torch.randn(2, 3, 64, 80))
    assert_exported_matches_eager(exported, model, [(1, 48, 96), (3, 128, 64)])


@pytest.mark.parametrize('phi', ['peripheral', 'irpe'])
def test_jit_trace_under_no_grad_holds_at_the_traced_size(phi):
    """The trace's own check runs the model twice; the grid constants are computed, not read from
    the cache, while tracing, so both runs record the same graph (an 11 x 13 grid no other test uses)."""
    model = randomised(posattn.create_model('vit_tiny', phi=phi, depth=1, num_classes=5))
    x = torch.randn(2, 3, 176, 208)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore')  # the tracer's and its deprecation's warnings
        traced = torch.jit.trace(model, x)
        torch.testing.assert_close(traced(x), model(x))
