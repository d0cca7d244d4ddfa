"""alibi: 2D ALiBi against the float64 formula, its slopes against ALiBi's released code, training, the
position cache, errors (the meta device, compile and torch.func: tests/test_gpu_readiness.py,
tests/test_compile.py and tests/test_function_transforms.py, which take every Φp)."""
import copy
import math
from decimal import Decimal, localcontext

import pytest
import torch
import torch.nn.functional as F

import posattn
from posattn import Attention, TokenGrid
from posattn.phi.alibi import ALiBi2D, alibi_slopes, grid_distances
from posattn.reference import alibi_bias, softmax_attention

GRIDS = [(3, 5), (4, 7)]


def released_slopes(n):
    """ALiBi's ``get_slopes`` as released (Press et al., ofirpress/attention_with_linear_biases,
    fairseq/models/transformer.py; CROMA copies it): Python floats and math.log2."""
    def get_slopes_power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return get_slopes_power_of_2(closest_power_of_2) + released_slopes(2 * closest_power_of_2)[0::2][
        :n - closest_power_of_2]


def bias_of(phi, height, width, prefix, dtype=torch.float64):
    tokens = prefix + height * width
    q = torch.zeros(1, phi.num_heads, tokens, 8, dtype=dtype)
    return phi.logits_bias(q, None, TokenGrid(height, width, prefix))


@pytest.mark.parametrize('height,width', GRIDS)
@pytest.mark.parametrize('prefix', [0, 1, 2])
def test_bias_matches_the_float64_formula(height, width, prefix):
    """-m_h ||p_i - p_j|| over grid pairs, zero wherever a prefix token is."""
    phi = posattn.build_phi('alibi', num_heads=6)
    got = bias_of(phi, height, width, prefix)[0]
    tokens = prefix + height * width
    assert got.shape == (6, tokens, tokens) and got.dtype == torch.float64
    expected = alibi_bias(released_slopes(6), height, width)
    torch.testing.assert_close(got[:, prefix:, prefix:], expected, rtol=0, atol=1e-14)
    assert torch.all(got[:, :prefix] == 0) and torch.all(got[:, :, :prefix] == 0)


@pytest.mark.parametrize('height,width', GRIDS)
@pytest.mark.parametrize('prefix', [0, 1])
def test_layer_output_matches_softmax_attention_with_the_bias(height, width, prefix, device):
    """The layer (on ``pytest --device``) is the float64 softmax attention with the reference's bias."""
    torch.manual_seed(0)
    layer = Attention(24, 3, phi='alibi', num_prefix_tokens=prefix).double()
    x = torch.randn(2, prefix + height * width, 24, dtype=torch.float64)
    with torch.no_grad():
        expected = softmax_attention(x, layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias, 3,
                                     alibi_bias(released_slopes(3), height, width), num_prefix_tokens=prefix)
        out = layer.to(device)(x.to(device), (height, width)).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_three_heads_take_the_released_slopes():
    """Not 2^(-8/3), 2^(-16/3), 2^-8: the two slopes of 2 heads, then the first of 4 heads."""
    assert alibi_slopes(3, torch.float64).tolist() == [0.0625, 0.00390625, 0.25]
    assert posattn.build_phi('alibi', num_heads=3).slopes.tolist() == [0.0625, 0.00390625, 0.25]
    assert alibi_slopes(6, torch.float64).tolist() == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]
    assert alibi_slopes(8, torch.float64).tolist() == [2.0 ** -k for k in range(1, 9)]  # the paper's example


@pytest.mark.parametrize('num_heads', range(1, 17))
def test_slopes_equal_the_released_get_slopes(num_heads):
    """Bit for bit in float32 (the module's dtype), and in float64 up to 9 heads, where the release's
    float arithmetic is exact. From 10 heads on the release rounds start * ratio**i step by step (16
    heads: 0.5000000000000001 for 2^-1); posattn's float64 slope is then the nearest float64 to the
    release's exact 2^e, checked in 60-digit decimal arithmetic."""
    release = released_slopes(num_heads)
    assert torch.equal(alibi_slopes(num_heads), torch.tensor(release, dtype=torch.float32))
    got = alibi_slopes(num_heads, torch.float64).tolist()
    assert len(got) == num_heads
    if num_heads <= 9:
        assert got == release
    steps = max(1, 2 ** math.floor(math.log2(num_heads)) // 4)  # e: a multiple of 8 / (2p), or an integer
    for ours, theirs in zip(got, release):
        assert math.isclose(ours, theirs, rel_tol=1e-14)
        exponent = Decimal(round(steps * math.log2(theirs))) / steps
        with localcontext() as context:
            context.prec = 60
            assert ours == float(Decimal(2) ** exponent)


def test_a_class_token_and_the_grid_distances_pair_by_pair():
    """Against a loop over the tokens of a 3 x 4 grid after one class token: 0 wherever the class token
    is, else -m_h times math.hypot of the row and column offsets."""
    height, width, slopes = 3, 4, released_slopes(5)
    got = bias_of(posattn.build_phi('alibi', num_heads=5), height, width, 1)[0]  # (5, 13, 13)
    cells = [None] + [divmod(index, width) for index in range(height * width)]  # token -> (row, col)
    expected = torch.zeros(5, len(cells), len(cells), dtype=torch.float64)
    for h, slope in enumerate(slopes):
        for i, query in enumerate(cells):
            for j, key in enumerate(cells):
                if query is not None and key is not None:
                    expected[h, i, j] = -slope * math.hypot(query[0] - key[0], query[1] - key[1])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    # The last slope is 2^-1, so this is math.hypot exactly; within an ulp, as torch's float64 sqrt need
    # not be correctly rounded (some CPU builds give 1.414213562373095 for the root of 2).
    hypot = -expected[-1, 1:, 1:] / slopes[-1]
    torch.testing.assert_close(grid_distances(height, width, torch.float64), hypot, rtol=2 ** -52, atol=0)


def test_neighbours_and_diagonals_in_grid_units():
    bias = bias_of(posattn.build_phi('alibi', num_heads=1), 2, 3, 0)[0, 0]  # slope 2^-8
    assert bias[0, 0] == 0 and bias[0, 1] == -2 ** -8 and bias[0, 3] == -2 ** -8
    assert bias[0, 5].item() == pytest.approx(-math.sqrt(5) * 2 ** -8, rel=1e-7)  # (0, 0) to (1, 2)
    assert torch.equal(bias, bias.t())


def test_has_no_parameters_or_state():
    phi = posattn.build_phi('alibi', num_heads=4)
    assert not list(phi.parameters()) and not list(phi.buffers()) and phi.state_dict() == {}


def test_bias_is_in_the_queries_dtype():
    bias = bias_of(posattn.build_phi('alibi', num_heads=2), 4, 2, 1, dtype=torch.bfloat16)
    assert bias.dtype == torch.bfloat16 and bias.shape == (1, 2, 9, 9)


# --- models, training ----------------------------------------------------------------------

def test_a_training_step_of_a_vit():
    torch.manual_seed(0)
    model = posattn.create_model('vit_tiny', phi='alibi', depth=1, num_classes=5).train()
    assert isinstance(model.blocks[0].attn.phi, ALiBi2D)
    weights = model.blocks[0].attn.qkv.weight
    before = weights.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = F.cross_entropy(model(torch.randn(2, 3, 64, 48)), torch.tensor([1, 3]))
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and not torch.equal(weights, before)


def test_swapped_into_a_timm_vit_the_bias_reaches_the_logits():
    timm = pytest.importorskip('timm')
    model = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, embed_dim=32, depth=2,
                              num_heads=2, num_classes=5).eval()
    swapped = posattn.swap_attention(copy.deepcopy(model), phi='alibi')
    assert len([m for m in swapped.modules() if isinstance(m, ALiBi2D)]) == 2
    seen = []
    swapped.blocks[0].attn.logits_probe.register_forward_hook(lambda m, args, out: seen.append(args))
    with torch.no_grad():
        swapped(torch.randn(1, 3, 32, 32))
    (q, k, bias, grid), = seen
    torch.testing.assert_close(bias[0, :, 1:, 1:], alibi_bias(released_slopes(2), 4, 4).float())


# --- cache ---------------------------------------------------------------------------------

def test_the_position_cache_serves_one_bias_per_grid_and_dtype():
    layer = Attention(16, 2, phi='alibi', num_prefix_tokens=1).eval()
    q = torch.zeros(1, 2, 13, 8)
    with torch.no_grad(), posattn.cache_positions(layer) as cache:
        first = layer.phi.logits_bias(q, None, TokenGrid(3, 4, 1))
        assert layer.phi.logits_bias(q, None, TokenGrid(3, 4, 1)) is first
        other = layer.phi.logits_bias(torch.zeros(1, 2, 13, 8, dtype=torch.float64), None, TokenGrid(4, 3, 1))
        assert other.dtype == torch.float64 and not torch.equal(other.float(), first)  # 3x4 is not 4x3
        assert len(cache) == 2
    assert layer.phi.position_cache is None


def test_bad_num_heads_names_the_problem():
    with pytest.raises(ValueError, match='alibi num_heads must be an int >= 1, got 0'):
        posattn.build_phi('alibi', num_heads=0)


@pytest.mark.parametrize('num_heads', [0, -3, 2.0, True])
def test_bad_num_heads_of_the_slopes_names_the_problem(num_heads):
    with pytest.raises(ValueError, match=f'alibi_slopes needs an int num_heads >= 1, got {num_heads!r}'):
        alibi_slopes(num_heads)
