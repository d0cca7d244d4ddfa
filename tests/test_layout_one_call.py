"""A layout in one attention call: which Φp take it, and that no layer reads a tensor back to the host
(on the CUDA path that would be a synchronisation per layer). The per-image exactness of every Φp is
tests/test_layout.py's and the per-Φp oracle tests'."""
import pytest
import torch

import posattn
from posattn import Attention, ImageLayout
from posattn.positions import token_positions

# Every Φp whose terms are per token or per pair of tokens, and stacks of them.
ONE_CALL = ['none', 'rope', 'alibi', 'rpb', 'decomposed_rpb', 'irpe', 'gpsa', ['rope', 'rpb'], ['alibi', 'gpsa']]
PER_GRID = ['peg', 'peripheral', ['peg', 'irpe']]
GRIDS = [(2, 3), (3, 2), (1, 4), (3, 3)]


def layer(phi, prefix=1, dim=16, heads=2):
    options = [dict(mode='ctx', on='qkv') if name == 'irpe' else None for name in phi] if isinstance(phi, list) \
        else dict(mode='ctx', on='qkv') if phi == 'irpe' else None
    return Attention(dim, heads, phi=phi, phi_cfg=options, num_prefix_tokens=prefix)


@pytest.mark.parametrize('phi', ONE_CALL, ids=str)
def test_the_phi_whose_terms_are_per_token_or_pair_run_a_layout_in_one_call(phi, monkeypatch):
    attention = layer(phi)
    assert attention.phi.runs_on_token_positions
    layout = ImageLayout.padded(GRIDS, 1)
    monkeypatch.setattr(type(layout), 'per_grid', lambda *args: pytest.fail('ran once per grid'))
    attention(torch.randn(layout.num_rows, layout.length, 16), layout).sum().backward()


@pytest.mark.parametrize('phi', PER_GRID, ids=str)
def test_a_phi_that_needs_a_canvas_runs_once_per_distinct_grid(phi):
    assert not layer(phi).phi.runs_on_token_positions


@pytest.mark.parametrize('phi', ONE_CALL, ids=str)
def test_a_layout_runs_forward_and_backward_on_the_meta_device(phi):
    """Any read of a value (.item(), a bool of a tensor, a mask selecting a data-dependent count)
    fails on the meta device: the one-call path has none."""
    attention = layer(phi).to('meta')
    layout = ImageLayout.packed(GRIDS, 1)
    x = torch.randn(layout.num_rows, layout.length, 16, device='meta', requires_grad=True)
    out = attention(x, layout)
    assert out.shape == x.shape and out.device.type == 'meta'
    out.sum().backward()


READS = ('item', 'tolist', 'cpu', 'numpy', '__bool__', '__int__', '__float__', '__index__')


@pytest.mark.parametrize('phi', ['none', 'rope', 'rpb', 'irpe'])
def test_no_layer_reads_a_tensor_back_once_the_layout_is_known(phi, monkeypatch):
    attention = layer(phi)
    layout = ImageLayout.padded(GRIDS, 1)
    x = torch.randn(layout.num_rows, layout.length, 16, requires_grad=True)
    attention(x, layout)  # the layout's positions are made on the host once, then cached
    reads = []
    for name in READS:
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _f=original, **k: reads.append(_n)
                            or _f(self, *a, **k))
    out = attention(x, layout)
    out.sum().backward()
    monkeypatch.undo()
    assert reads == []


def test_positions_place_each_token_and_put_the_rows_back():
    layout = ImageLayout.packed([(2, 3), (1, 2)], num_prefix_tokens=1, length=12)
    positions = token_positions(layout, 2, torch.device('cpu'))
    assert positions.valid.tolist() == [[True] * 7, [True] * 3 + [False] * 4]
    assert positions.row[0].tolist() == [0, 0, 0, 0, 1, 1, 1] and positions.col[0].tolist() == [0, 0, 1, 2, 0, 1, 2]
    assert positions.is_prefix[:, 0].all() and not positions.is_grid[:, 0].any()
    x = torch.arange(2 * 12, dtype=torch.float64).view(2, 12, 1)
    rows = positions.gather(x)
    assert rows[1, :3, 0].tolist() == [7.0, 8.0, 9.0]
    back = positions.place(rows)
    assert back[0, :10].flatten().tolist() == list(map(float, range(10))) and not back[0, 10:].any()
    assert not back[1].any()


def test_rows_that_are_the_images_get_zero_padding_and_a_bias_gets_minus_infinity_at_padding_keys():
    """A NaFlex batch (one image a row, from its first token): gathering moves nothing but zeroes the
    padding, whatever it held; a bias of every image gets -inf at each padding key, nowhere else."""
    layout = ImageLayout.padded([(2, 3), (1, 2)], num_prefix_tokens=1)
    positions = token_positions(layout, 2, torch.device('cpu'))
    assert positions.rows_are_images
    x = torch.full((2, 7, 3), float('nan'))
    x[0], x[1, :3] = 1.0, 2.0
    rows = positions.gather(x)
    assert (rows[0] == 1).all() and (rows[1, :3] == 2).all() and (rows[1, 3:] == 0).all()
    assert torch.equal(positions.place(rows), rows)
    bias = torch.zeros(2, 4, 7, 7)
    assert positions.mask_padding_keys_(bias) is bias
    padding_keys = ~positions.valid[:, None, None, :].expand_as(bias)
    assert (bias[padding_keys] == float('-inf')).all() and (bias[~padding_keys] == 0).all()


def test_attention_that_is_told_every_row_keeps_a_key_gives_what_it_gives_when_it_checks():
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    keys = torch.tensor([[True] * 5, [True, True, False, False, False], [False, True, False, True, False]])
    bias = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    checked = posattn.functional.biased_attention(q, k, v, bias, keys)
    trusted = posattn.functional.biased_attention(q, k, v, bias, keys, keeps_a_key=True)
    torch.testing.assert_close(trusted, checked, rtol=0, atol=0)
    probs = posattn.functional.attention_probs(q, k, bias, keys, keeps_a_key=True)
    torch.testing.assert_close(probs, posattn.functional.attention_probs(q, k, bias, keys), rtol=0, atol=0)
