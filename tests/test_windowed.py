"""Windowed peripheral attention: partition/merge, the exact key mask, PerViT's windows and global
blocks, against float64 references computed window by window on the real tokens only."""
import pytest
import torch

from posattn import Attention, TokenGrid, cache_positions, functional
from posattn.functional import attention_probs, biased_attention
from posattn.models.pervit import PerViT, PerViTBlock
from posattn.phi.peripheral import PeripheralPhi
from posattn.window import GridWindows

SMALL = dict(embed_dims=(16, 24), depths=(2, 2), num_heads=2, stem_dims=(4, 8))  # stride 4


def small_pervit(**kwargs):
    torch.manual_seed(0)
    return PerViT(**SMALL, num_classes=0, **kwargs).double()


def masked_naive(q, k, v, bias, key_mask):
    """softmax over the kept keys only, written out: the masked keys are removed, not weighted."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        keep = key_mask[b]
        scores = q[b] @ k[b][:, keep].transpose(-2, -1) / q.shape[-1] ** 0.5 + bias[0][:, :, keep]
        out[b] = scores.softmax(-1) @ v[b][:, keep]
    return out


def test_partition_merge_round_trip_and_mask_on_a_non_square_grid():
    windows = GridWindows(TokenGrid(5, 7), 3)
    x = torch.randn(2, 35, 4)
    parts = windows.partition(x)
    assert (windows.rows, windows.cols, windows.padded) == (2, 3, True)
    assert parts.shape == (2 * 6, 9, 4)
    torch.testing.assert_close(windows.merge(parts), x, rtol=0, atol=0)
    # window (row 1, col 2) of image 1 holds grid rows 3..4 (5 is padding), cols 6 (7, 8 are padding)
    torch.testing.assert_close(parts[6 + 5].view(3, 3, 4)[:2, :1], x[1].view(5, 7, 4)[3:5, 6:7])
    mask = windows.key_mask(2)
    assert mask.shape == (12, 9) and mask.sum() == 2 * 35
    assert mask[5].view(3, 3).tolist() == [[True, False, False], [True, False, False], [False, False, False]]
    torch.testing.assert_close(parts[~mask], torch.zeros(int((~mask).sum()), 4), rtol=0, atol=0)
    assert GridWindows(TokenGrid(6, 9), 3).key_mask(2) is None


def test_grid_windows_errors():
    with pytest.raises(ValueError, match='window_size must be a positive int, got 0'):
        GridWindows(TokenGrid(4, 4), 0)
    with pytest.raises(ValueError, match='prefix tokens, which belong to no window'):
        GridWindows(TokenGrid(4, 4, 1), 2)
    with pytest.raises(ValueError, match='got 15 tokens for a 4x4 grid'):
        GridWindows(TokenGrid(4, 4), 2).partition(torch.randn(1, 15, 3))
    with pytest.raises(ValueError, match=r'window_size must be a \(height, width\) pair of positive ints, '
                                         r'got \(3, 0\)'):
        GridWindows(TokenGrid(4, 4), (3, 0))
    with pytest.raises(ValueError, match=r'0 <= shift < the window side, for 2x3 windows got \(2, 1\)'):
        GridWindows(TokenGrid(4, 4), (2, 3), shift=(2, 1))


def coordinates(height, width):
    """(1, H*W, 2): each token's (row, col) + 1, so that zero padding tells itself apart."""
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing='ij')
    return torch.stack([rows, cols], -1).reshape(1, height * width, 2).double() + 1


def test_shifted_windows_roll_the_map_and_mark_the_pairs_the_roll_wraps_around():
    """Swin's shifted windows on a 6 x 8 grid, 3 x 4 windows rolled by (1, 2): the first window
    starts at (1, 2); within a window two tokens are of one region unless the roll brought one of
    them from the other end of the map along a side."""
    windows = GridWindows(TokenGrid(6, 8), (3, 4), shift=(1, 2))
    x = coordinates(6, 8)
    parts = windows.partition(x)  # (4, 12, 2)
    assert (windows.window_grid, windows.padded, parts.shape) == (TokenGrid(3, 4), False, (4, 12, 2))
    torch.testing.assert_close(windows.merge(parts), x, rtol=0, atol=0)
    assert parts[0, 0].tolist() == [2, 3] and parts[3, -1].tolist() == [1, 2]  # (1, 2), then (0, 1) wrapped
    grid_rows, grid_cols = (parts - 1).unbind(-1)  # (4, 12) each
    wrapped = (grid_rows < 1).long() + 2 * (grid_cols < 2).long()  # which sides the roll wrapped it around
    expected = wrapped[:, :, None] != wrapped[:, None, :]
    assert torch.equal(windows.shift_mask(), expected) and expected[0].sum() == 0 and expected[3].any()
    assert GridWindows(TokenGrid(6, 8), (3, 4)).shift_mask() is None


def test_shifted_windows_of_a_padded_grid_mask_the_padding_where_the_roll_put_it():
    windows = GridWindows(TokenGrid(5, 7), 3, shift=(1, 1))
    x = coordinates(5, 7).expand(2, -1, -1)
    parts = windows.partition(x)
    torch.testing.assert_close(windows.merge(parts), x, rtol=0, atol=0)
    real = parts.ne(0).any(-1)  # (2 * 6, 9)
    assert torch.equal(windows.key_mask(2), real)
    # the last window holds rolled rows 3..5, cols 6..8: grid rows 4, 5 (padding), 0 and cols 7, 8 (padding), 0
    assert real[5].view(3, 3).tolist() == [[False, False, True], [False, False, False], [False, False, True]]


@pytest.mark.parametrize('bias_shape', [(1, 2, 6, 6), (3, 2, 6, 6), None])
def test_key_mask_values_and_gradients_match_attention_on_the_kept_keys(monkeypatch, bias_shape):
    monkeypatch.setattr(functional, '_BLOCK_ELEMENTS', 30)  # several tiles in the CPU backward
    monkeypatch.setattr(functional, '_TILE_ROWS', 4)
    q, k, v = [torch.randn(3, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    key_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    bias = (torch.zeros(1, 2, 6, 6, dtype=torch.float64) if bias_shape is None
            else torch.randn(bias_shape, dtype=torch.float64, requires_grad=True))
    inputs = (q, k, v) + ((bias,) if bias.requires_grad else ())
    upstream = torch.randn(3, 2, 6, 4, dtype=torch.float64)
    out = biased_attention(q, k, v, bias if bias_shape else None, key_mask)
    grads = torch.autograd.grad((out * upstream).sum(), inputs)
    expected = torch.stack([masked_naive(q[b:b + 1], k[b:b + 1], v[b:b + 1], bias[min(b, bias.shape[0] - 1)][None],
                                         key_mask[b:b + 1])[0] for b in range(3)])
    expected_grads = torch.autograd.grad((expected * upstream).sum(), inputs)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    probs = attention_probs(q, k, bias, key_mask)
    assert probs[~key_mask[:, None, None, :].expand_as(probs)].abs().max() == 0
    torch.testing.assert_close(probs @ v, expected, rtol=1e-10, atol=1e-12)


def test_key_mask_errors():
    q = torch.randn(2, 1, 5, 4)
    with pytest.raises(ValueError, match=r'key_mask must be a bool tensor of shape \(B, N\) = \(2, 5\), '
                                         r'got torch.float32 of shape \(2, 5\)'):
        biased_attention(q, q, q, key_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r'got torch.bool of shape \(1, 5\)'):
        Attention(4, 1)(torch.randn(2, 5, 4), (1, 5), key_mask=torch.ones(1, 5, dtype=torch.bool))


def reference_windowed_attention(layer: Attention, x: torch.Tensor, height: int, width: int, ws: int,
                                 distance_embedding=None):
    """Per window, attention among its real tokens only, Φp of the ws x ws window restricted to them."""
    log_phi = layer.phi.log_position_attention(ws, ws, distance_embedding)  # (heads, ws*ws, ws*ws)
    heads, head_dim = layer.num_heads, layer.head_dim
    grid = x.view(x.shape[0], height, width, -1)
    out = torch.zeros_like(x).view_as(grid)
    for r0 in range(0, height, ws):
        for c0 in range(0, width, ws):
            rows, cols = range(r0, min(r0 + ws, height)), range(c0, min(c0 + ws, width))
            local = torch.tensor([(r - r0) * ws + (c - c0) for r in rows for c in cols])
            tokens = grid[:, r0:r0 + len(rows), c0:c0 + len(cols)].reshape(x.shape[0], -1, x.shape[-1])
            q, k, v = layer.qkv(tokens).view(x.shape[0], -1, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-2, -1) / head_dim ** 0.5 + log_phi[:, local][:, :, local]
            mixed = (scores.softmax(-1) @ v).transpose(1, 2).reshape(tokens.shape)
            out[:, r0:r0 + len(rows), c0:c0 + len(cols)] = layer.proj(mixed).view(
                x.shape[0], len(rows), len(cols), -1)
    return out.view_as(x)


@pytest.mark.parametrize('height,width,ws', [(5, 7, 3), (4, 4, 3), (2, 3, 4), (6, 4, 2)])
def test_padded_windows_equal_attention_restricted_to_the_real_tokens(height, width, ws):
    block = PerViTBlock(8, 8, 2, PeripheralPhi(2), window_size=ws).double()
    for param in block.attn.phi.parameters():  # away from the release's constant initialisation
        param.data.add_(0.3 * torch.randn_like(param))
    x = torch.randn(2, height * width, 8, dtype=torch.float64, requires_grad=True)
    params = list(block.attn.parameters())
    got = block._attend(x, TokenGrid(height, width), {})
    expected = reference_windowed_attention(block.attn, x, height, width, ws)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    upstream = torch.randn_like(got)
    grads = torch.autograd.grad((got * upstream).sum(), [x, *params])
    expected_grads = torch.autograd.grad((expected * upstream).sum(), [x, *params])
    for got_grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(got_grad, want, rtol=1e-9, atol=1e-11)


def test_a_window_as_large_as_the_grid_is_global_attention():
    global_model, windowed = small_pervit(), small_pervit(window_size=6)
    windowed.load_state_dict(global_model.state_dict())
    images = torch.randn(2, 3, 24, 24, dtype=torch.float64)  # a 6 x 6 grid: one window, no padding
    torch.testing.assert_close(windowed.forward_features(images), global_model.forward_features(images),
                               rtol=1e-12, atol=1e-12)
    global_model.forward_features(images).square().sum().backward()
    windowed.forward_features(images).square().sum().backward()
    for (name, got), want in zip(windowed.named_parameters(), global_model.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_windows_and_global_blocks_on_a_non_square_grid(monkeypatch):
    """Blocks 0, 2 attend in 3 x 3 windows of the 5 x 7 grid, blocks 1, 3 over the whole grid."""
    model = small_pervit(window_size=3, global_blocks=(1, 3))
    assert [block.window_size for block in model.blocks] == [3, None, 3, None]
    grids = []
    original = PeripheralPhi.log_position_attention
    monkeypatch.setattr(PeripheralPhi, 'log_position_attention',
                        lambda self, h, w, *embedding: grids.append((h, w)) or original(self, h, w, *embedding))
    images = torch.randn(2, 3, 20, 28, dtype=torch.float64)
    out = model.forward_features(images)
    assert out.shape == (2, 24, 5, 7) and torch.isfinite(out).all()
    assert grids == [(3, 3), (5, 7), (3, 3), (5, 7)]  # once per layer, shared by every window and image
    x, grid = model.stem(images)
    expected = x
    for block in model.blocks:  # each windowed block against the per-window reference
        tokens = block.norm1(block.cpe.tokens(expected, grid))
        attended = (block.attn(tokens, grid, distance_embedding=model.distance_embedding) if block.window_size is None
                    else reference_windowed_attention(block.attn, tokens, 5, 7, 3, model.distance_embedding))
        expected = expected + attended
        expected = block.res(expected) + block.mlp(block.norm2(expected))
    torch.testing.assert_close(out, model.norm(expected).transpose(1, 2).reshape(2, 24, 5, 7),
                               rtol=1e-10, atol=1e-12)
    model.eval()
    grids.clear()
    with torch.no_grad(), cache_positions(model):
        model.forward_features(images)
        model.forward_features(images[:1])
    assert grids == [(3, 3), (5, 7), (3, 3), (5, 7)]  # cached per grid, whatever the batch


def test_default_is_global_and_bad_options_are_refused():
    assert all(block.window_size is None for block in small_pervit().blocks)
    with pytest.raises(ValueError, match=r'global_blocks \(1,\) needs window_size'):
        PerViT(**SMALL, global_blocks=(1,))
    with pytest.raises(ValueError, match=r'global_blocks \(4,\) must be block indices in 0..3'):
        PerViT(**SMALL, window_size=3, global_blocks=(4,))
    with pytest.raises(ValueError, match='window_size must be None or a positive int, got 0'):
        PerViT(**SMALL, window_size=0)


def test_logits_probe_sees_the_key_mask_by_keyword():
    block = PerViTBlock(8, 8, 2, PeripheralPhi(2), window_size=3)
    seen = []
    block.attn.logits_probe.register_forward_hook(
        lambda module, args, kwargs, output: seen.append((args[2].shape, args[3], kwargs['key_mask'].shape)),
        with_kwargs=True)
    block._attend(torch.randn(2, 20, 8), TokenGrid(4, 5), {})
    assert seen == [((1, 2, 9, 9), TokenGrid(3, 3), (2 * 4, 9))]
