"""iRPE: the release fixture, float64 references for every method / mode / target, gradients, errors;
the tests that take ``device`` run iRPE on ``pytest --device`` (conftest.py), the references on the CPU."""
import pytest
import torch

import posattn
from posattn import Attention, TokenGrid
from posattn.phi.irpe import bucket_ids
from posattn.reference import irpe_attention, irpe_bucket_ids

from conftest import gradcheck_layer, load_fixture
from release_fixtures import IRPE, load_trimmed

METHODS = ['euc', 'quant', 'cross', 'product']


# --- float64 references (posattn.reference) ------------------------------------------------

def reference_attention(x, layer, tables, ids, mode):
    return irpe_attention(x, layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias,
                          layer.num_heads, tables, ids, mode)


def random_tables(phi, generator):
    """Random release-named tables of the right shapes for every target of ``phi``."""
    return {target: {name: torch.randn(p.shape, generator=generator, dtype=torch.float64)
                     for name, p in getattr(phi, f'rpe_{target}').named_parameters()}
            for target in phi.on}


def as_lists(phi, tables):
    names = (['rp_rows', 'rp_cols'] if phi.method == 'cross' else [None])
    suffix = 'lookup_table_bias' if phi.mode == 'bias' else 'lookup_table_weight'
    return {target: [named[f'{axis}.{suffix}' if axis else suffix] for axis in names]
            for target, named in tables.items()}


# --- the release ------------------------------------------------------------------------------

@pytest.mark.parametrize('kind', ['trimmed', 'full'])
def test_matches_release_fixture(kind, device):
    """The release's bucket ids and bias; the trimmed fixture keeps one image and head, and every
    fourth query row of the bias."""
    fixture = load_trimmed(IRPE[1]) if kind == 'trimmed' else load_fixture(IRPE[0])
    rows = fixture.get('rows', slice(None))
    num_heads = fixture['q'].shape[1]  # the heads share one table
    phi = posattn.build_phi('irpe', num_heads=num_heads, head_dim=64, method='product', mode='ctx', on='k',
                            shared_head=True, ratio=1.9, num_prefix_tokens=1)
    phi.load_release_tables({'k': {'lookup_table_weight': fixture['lookup_table_weight']}})
    assert torch.equal(bucket_ids(14, 14, 1, 'product', 1.9)[0], fixture['bucket_ids'].long())
    with torch.no_grad():
        out = phi.to(device).term('k', fixture['q'].to(device), (14, 14)).cpu()
    torch.testing.assert_close(out[:, :, rows], fixture['out'], rtol=0, atol=1e-6)


@pytest.mark.parametrize('ratio,per_axis', [(1.9, 7), (2.0, 9), (2.5, 11), (3.0, 13)])
def test_buckets_per_axis(ratio, per_axis):
    cross = bucket_ids(25, 25, 0, 'cross', ratio)  # offsets up to 24 reach beta
    assert cross[0].unique().numel() == per_axis and cross[1].unique().numel() == per_axis
    product = posattn.build_phi('irpe', num_heads=1, head_dim=4, ratio=ratio, num_prefix_tokens=1)
    assert product.num_buckets == per_axis ** 2 + 1


@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('ratio', [1.9, 2.5, 0.7])
def test_bucket_ids_pair_by_pair(method, ratio):
    """Non-square grids with extra tokens, offsets far enough to reach the logarithmic part."""
    for height, width, skip in [(7, 11, 2), (1, 9, 0), (6, 1, 1), (7, 9, 1), (14, 14, 1)]:
        expected = irpe_bucket_ids(height, width, skip, method, ratio)
        assert torch.equal(bucket_ids(height, width, skip, method, ratio), expected), (height, width, skip)


def test_bucket_ids_are_cached_by_their_arguments():
    first = bucket_ids(5, 6, 1, 'product', 1.9)
    assert bucket_ids(5, 6, 1, 'product', 1.9) is first
    assert bucket_ids(5, 6, 2, 'product', 1.9).shape == (1, 32, 32)
    assert bucket_ids(6, 5, 1, 'product', 1.9) is not first


# --- every method, mode and target against the float64 reference -----------------------------

CASES = [(method, mode, on, shared) for method in METHODS for mode in ('bias', 'ctx')
         for on in (('q', 'k', 'qk') if mode == 'bias' else ('q', 'k', 'v', 'qk', 'kv', 'qkv'))
         for shared in (True, False)]


@pytest.mark.parametrize('method,mode,on,shared', CASES)
def test_layer_equals_reference(method, mode, on, shared, device):
    height, width, skip = 3, 5, 2
    layer = Attention(16, 2, phi='irpe', num_prefix_tokens=skip, phi_cfg=dict(
        method=method, mode=mode, on=on, shared_head=shared, ratio=1.2, num_prefix_tokens=skip)).double()
    tables = random_tables(layer.phi, torch.Generator().manual_seed(len(on) + 7 * shared))
    layer.phi.load_release_tables(tables)
    x = torch.randn(2, skip + height * width, 16, dtype=torch.float64)
    expected = reference_attention(x, layer, as_lists(layer.phi, tables),
                                   irpe_bucket_ids(height, width, skip, method, 1.2), mode)
    out = layer.to(device)(x.to(device), (height, width))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('mode,on', [('bias', 'q'), ('ctx', 'q'), ('ctx', 'v')])
def test_term_orientation(mode, on):
    """term('q') is [b, h, query, key]; term('v') is added to the output; both per the reference."""
    phi = posattn.build_phi('irpe', num_heads=2, head_dim=4, method='product', mode=mode, on=on,
                            shared_head=False, ratio=1.9, num_prefix_tokens=1).double()
    tables = random_tables(phi, torch.Generator().manual_seed(3))
    phi.load_release_tables(tables)
    (table,) = as_lists(phi, tables)[on]
    ids = irpe_bucket_ids(2, 3, 1, 'product', 1.9)[0]
    if on == 'v':
        attn = torch.rand(3, 2, 7, 7, dtype=torch.float64).softmax(-1)
        expected = torch.einsum('bhij,hijd->bhid', attn, table[:, ids])
        torch.testing.assert_close(phi.term('v', attn, (2, 3)), expected)
        return
    keys = torch.randn(3, 2, 7, 4, dtype=torch.float64)
    if mode == 'bias':
        expected = table[:, ids].transpose(-1, -2).expand(3, -1, -1, -1)
    else:
        expected = torch.stack([torch.stack([torch.stack([keys[b, h, j] @ table[h, :, ids[j, i]]
                                                          for j in range(7)]) for i in range(7)])
                                for b in range(3) for h in range(2)]).view(3, 2, 7, 7)
    torch.testing.assert_close(phi.term('q', keys, TokenGrid(2, 3, 1)).expand(3, -1, -1, -1), expected)


def test_zero_tables_are_the_plain_layer():
    layer = Attention(16, 2, phi='irpe', phi_cfg=dict(on='qkv', shared_head=False, num_prefix_tokens=1),
                      num_prefix_tokens=1)
    plain = Attention(16, 2, num_prefix_tokens=1)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith('phi.')})
    x = torch.randn(2, 1 + 4 * 3, 16)
    torch.testing.assert_close(layer(x, (4, 3)), plain(x, (4, 3)), rtol=0, atol=1e-6)
    assert all(torch.count_nonzero(p) == 0 for p in layer.phi.parameters())


@pytest.mark.parametrize('height,width', [(7, 9), (14, 14)])
@pytest.mark.parametrize('method,shared', [('euc', False), ('product', True)])
def test_bias_mode_is_batch_free_and_any_grid_size(height, width, method, shared):
    """Bias mode on q and k: T_k[h, id(i, j)] + T_q[h, id(j, i)] with the reference's bucket ids
    (posattn.reference, pair by pair), one (1, heads, N, N) map whatever the queries and keys."""
    phi = posattn.build_phi('irpe', num_heads=4, head_dim=8, method=method, mode='bias', on='qk',
                            shared_head=shared, num_prefix_tokens=1).double()
    tables = random_tables(phi, torch.Generator().manual_seed(height * width))
    phi.load_release_tables(tables)
    lists = as_lists(phi, tables)
    ids = irpe_bucket_ids(height, width, 1, method, phi.ratio)[0]
    expected = lists['k'][0][:, ids] + lists['q'][0][:, ids].transpose(-1, -2)  # (1 or heads, N, N)
    tokens = 1 + height * width
    q, k = torch.randn(2, 3, 4, tokens, 8, dtype=torch.float64)
    bias = phi.logits_bias(q, k, TokenGrid(height, width, 1))
    assert bias.shape == (1, 1 if shared else 4, tokens, tokens)
    torch.testing.assert_close(bias[0], expected, rtol=0, atol=0)
    torch.testing.assert_close(phi.logits_bias(-3 * k, q, TokenGrid(height, width, 1)), bias, rtol=0, atol=0)


@pytest.mark.parametrize('method,mode,on', [('product', 'ctx', 'qkv'), ('cross', 'bias', 'qk'),
                                            ('euc', 'ctx', 'kv')])
def test_gradcheck(method, mode, on, device):
    """Gradients of the input and of every parameter, tables included, on a 2 x 3 grid with a class token."""
    layer = Attention(8, 2, phi='irpe', num_prefix_tokens=1, phi_cfg=dict(
        method=method, mode=mode, on=on, shared_head=False, ratio=0.9, num_prefix_tokens=1)).double()
    layer.phi.load_release_tables(random_tables(layer.phi, torch.Generator().manual_seed(1)))
    assert gradcheck_layer(layer.to(device), torch.randn(2, 7, 8, dtype=torch.float64).to(device), (2, 3))


# --- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize('cfg,message', [
    (dict(method='euclidean'), "unknown iRPE method 'euclidean'; choose one of euc, quant, cross, product"),
    (dict(mode='contextual'), "unknown iRPE mode 'contextual'; choose one of bias, ctx"),
    (dict(on='kq'), "unknown iRPE on='kq'; choose one of q, k, v, qk, kv, qkv"),
    (dict(mode='bias', on='kv'), "iRPE has no bias mode on v \\(on='kv'\\): use mode='ctx', or on='k'"),
    (dict(ratio=0), 'iRPE ratio must be a number > 0, got 0'),
    (dict(ratio=-1.9), 'iRPE ratio must be a number > 0, got -1.9'),
    (dict(num_prefix_tokens=-1), 'iRPE num_prefix_tokens .* must be an int >= 0, got -1'),
])
def test_bad_options(cfg, message):
    with pytest.raises(ValueError, match=message):
        posattn.build_phi('irpe', num_heads=2, head_dim=4, **cfg)


def test_tables_of_the_wrong_shape_name_the_expected_one():
    phi = posattn.build_phi('irpe', num_heads=3, head_dim=64, num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r'iRPE table k.lookup_table_weight has shape \(1, 64, 49\); '
                                         r'expected \(1, 64, 50\) for .*num_prefix_tokens=1.*\(50 buckets\)'):
        phi.load_release_tables({'k': {'lookup_table_weight': torch.zeros(1, 64, 49)}})
    with pytest.raises(ValueError, match=r"iRPE on 'k' needs tables for \['k'\], got \['q'\]"):
        phi.load_release_tables({'q': {'lookup_table_weight': torch.zeros(1, 64, 50)}})
    cross = posattn.build_phi('irpe', num_heads=3, head_dim=64, method='cross', mode='bias')
    with pytest.raises(ValueError, match=r"expected the names \['rp_cols.lookup_table_bias', "
                                         r"'rp_rows.lookup_table_bias'\], got \['lookup_table_bias'\]"):
        cross.load_release_tables({'k': {'lookup_table_bias': torch.zeros(1, 9)}})
    with pytest.raises(ValueError, match=r'rp_rows.lookup_table_bias has shape \(3, 9\); expected \(1, 7\)'):
        cross.load_release_tables({'k': {'rp_rows.lookup_table_bias': torch.zeros(3, 9),
                                         'rp_cols.lookup_table_bias': torch.zeros(1, 7)}})


def test_extra_tokens_must_agree_with_skip():
    layer = Attention(16, 2, phi='irpe', phi_cfg=dict(num_prefix_tokens=0), num_prefix_tokens=1)
    with pytest.raises(ValueError, match='iRPE built with num_prefix_tokens=0 got a 3x4 grid with 1 extra token: '
                                         'build it with num_prefix_tokens=1'):
        layer(torch.randn(2, 13, 16), (3, 4))
    phi = posattn.build_phi('irpe', num_heads=2, head_dim=8, num_prefix_tokens=1)
    with pytest.raises(ValueError, match='got 12 tokens for a 3x4 grid with 1 extra token; expected 13'):
        phi.term('k', torch.randn(2, 2, 12, 8), (3, 4))
    with pytest.raises(ValueError, match="this iRPE has tables on 'k', not on 'v'"):
        phi.term('v', torch.randn(2, 2, 13, 13), (3, 4))
    with pytest.raises(ValueError, match=r"expects \(B, 2 heads, L, ...\), got shape \(2, 3, 13, 8\)"):
        phi.term('k', torch.randn(2, 3, 13, 8), (3, 4))
