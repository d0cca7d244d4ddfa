"""Shared test helpers: the ``--device`` option and its ``device`` fixture, the full reference
fixtures in ../shared beside the checkout, seeded determinism, the tools' folder on the import path,
random peripheral Φp weights, and running the repository's tools in a subprocess."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / 'shared'
FIXTURES = SHARED / 'fixtures'
# The tools are scripts, not a package: the tests import their functions from here (appended, so
# that tools/test.py never shadows the standard library's test package).
if str(REPO / 'tools') not in sys.path:
    sys.path.append(str(REPO / 'tools'))


def pytest_addoption(parser):
    parser.addoption('--device', default='cpu', metavar='DEVICE',
                     help='device of the device-aware tests, those that take the `device` fixture: cpu '
                          '(default), cuda or cuda:N. The other tests run on the CPU whatever it is.')


def _requested_device(config) -> torch.device:
    """The ``--device`` of this run, checked: a CPU or an available CUDA device."""
    name = config.getoption('device')
    try:
        device = torch.device(name)
    except RuntimeError:
        raise pytest.UsageError(f'--device {name!r} is not a torch device; use cpu, cuda or cuda:N') from None
    if device.type not in ('cpu', 'cuda'):
        raise pytest.UsageError(f'--device {name}: the device-aware tests run on cpu or cuda, not {device.type}')
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise pytest.UsageError(f'--device {name}: torch {torch.__version__} sees no CUDA device '
                                '(torch.cuda.is_available() is False)')
    if device.type == 'cuda' and (device.index or 0) >= torch.cuda.device_count():
        raise pytest.UsageError(f'--device {name}: there are {torch.cuda.device_count()} CUDA devices')
    return device


def pytest_configure(config):
    _requested_device(config)  # a bad --device stops the run before collection


# The files that take longest (each a minute or more of end-to-end trainings on the 2-core machine), in
# that order: collected first, so that `make test`'s workers (one file each at a time, in collection
# order: --no-loadscope-reorder) start them first and finish together on the many short files.
LONGEST_FILES = ('test_tools_compare_phis.py', 'test_openmmlab_checkpoints.py', 'test_recipes.py',
                 'test_openmmlab_detseg.py', 'test_compile.py', 'test_swap_hf.py', 'test_your_data.py',
                 'test_openmmlab_train.py', 'test_tools_analyze.py', 'test_openmmlab_swap.py',
                 'test_tools_test_resolution.py', 'test_export.py', 'test_openmmlab_transformers.py')


def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept


def pytest_report_header(config):
    device = _requested_device(config)
    spec = importlib.util.find_spec('posattn')  # where it will be imported from, without importing it
    where = f'posattn from {Path(spec.origin).parent}' if spec and spec.origin else 'posattn: not found'
    if device.type != 'cuda':
        return [f'device-aware tests on: {device}', where]
    return [f'device-aware tests on: {device} ({torch.cuda.get_device_name(device)}), torch {torch.__version__}, '
            f'CUDA {torch.version.cuda}', where]


@pytest.fixture(scope='session')
def device(request) -> torch.device:
    """The device of the device-aware tests: ``pytest --device cuda``, the CPU by default.

    Their float32 comparisons hold for IEEE float32 products: on CUDA, TF32 (10-bit mantissas in
    matmuls and convolutions, which a user's setup may switch on) is off while the session runs.
    Inputs are drawn on the CPU and moved, so every device sees the values the CPU tests see.
    """
    device = _requested_device(request.config)
    if device.type != 'cuda':
        yield device
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield device
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def leaves_on(device, *tensors):
    """Detached copies of ``tensors`` on ``device``, each a leaf that requires grad."""
    return [t.detach().to(device).requires_grad_() for t in tensors]


def to_cpu(outputs):
    """``outputs`` (a tensor, or dicts, lists and tuples of them) with every tensor on the CPU."""
    if isinstance(outputs, torch.Tensor):
        return outputs.cpu()
    if isinstance(outputs, dict):
        return {key: to_cpu(value) for key, value in outputs.items()}
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(to_cpu(value) for value in outputs)
    return outputs


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield


def load_fixture(name):
    """A full reference file of ../shared/fixtures; skips where ../shared is absent (a user's clone),
    whose tests use the trimmed copies in tests/fixtures (``release_fixtures.load_trimmed``)."""
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(f'{path} is absent: the full reference fixtures live in ../shared beside the checkout; '
                    'the trimmed ones in tests/fixtures are checked instead')
    return torch.load(path, weights_only=True)


# What the OpenMMLab tests import: the `mm` extra of pyproject.toml, by module name.
OPENMMLAB_MODULES = ('mmengine', 'mmcv', 'mmpretrain', 'mmdet', 'mmseg', 'pycocotools')
# Those not installed, looked up without importing them.
MISSING_OPENMMLAB = [name for name in OPENMMLAB_MODULES if importlib.util.find_spec(name) is None]
OPENMMLAB_SKIP_REASON = (f'the OpenMMLab tests need {", ".join(MISSING_OPENMMLAB)}, not installed: '
                         "pip install '.[mm]' (mmcv 2.1.0 with its compiled ops: make setup)")


def require_openmmlab():
    """Skip the calling test module, at collection, where the OpenMMLab stack is not installed
    (``pip install .[test]`` alone): call it before the module's OpenMMLab imports."""
    if MISSING_OPENMMLAB:
        pytest.skip(OPENMMLAB_SKIP_REASON, allow_module_level=True)
    import posattn_openmmlab  # noqa: F401  (first, as the tools do: mmpretrain imports beside transformers 5)


# Marks a test that imports OpenMMLab inside its body, in a module whose other tests run without it:
# skipped, with the reason, where the stack is not installed.
needs_openmmlab = pytest.mark.skipif(bool(MISSING_OPENMMLAB), reason=OPENMMLAB_SKIP_REASON)


# (scale, shift) of the random peripheral Φp parameters, in PeripheralPhi.weights() order: w, PP1,
# IN1 weight and bias, PP2, IN2 weight and bias.
_PERIPHERAL_RANDOM = ((0.5, 0.0), (1 / 12, 0.0), (0.1, 1.0), (0.1, 0.0), (1 / 12, 0.0), (0.5, 1.0), (1.5, 0.0))


def randomise_peripheral(phi, seed):
    """Fill a PeripheralPhi's parameters with seeded random values (drawn in float64); returns it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param, (scale, shift) in zip(phi.weights(), _PERIPHERAL_RANDOM):
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * scale + shift)
    return phi


def gradcheck_layer(layer, x, hw):
    """torch.autograd.gradcheck of ``layer(x, hw)`` in the input and every parameter (float64)."""
    names = [n for n, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for _, p in layer.named_parameters())

    def run(x, *values):
        return torch.func.functional_call(layer, dict(zip(names, values)), (x, hw))
    # On CUDA, gather's backward and scatter_add (iRPE's contextual terms) add with atomics, in no
    # fixed order: two backward passes may differ in the last bits.
    nondet_tol = 1e-12 if x.device.type == 'cuda' else 0.0
    return torch.autograd.gradcheck(run, (x.requires_grad_(), *params), fast_mode=True, nondet_tol=nondet_tol)


def load_test_tool():
    """tools/test.py as a module (loaded by path: ``test`` is also the standard library's package)."""
    spec = importlib.util.spec_from_file_location('tools_test', REPO / 'tools' / 'test.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool(*command, timeout, env=None):
    """Run ``command`` from the repository root (e.g. ``sys.executable, 'tools/train.py', ...``) and
    return its stdout + stderr; a non-zero exit fails the test with the tail of both."""
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                            env=dict(os.environ, **(env or {})))
    assert result.returncode == 0, f'{" ".join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}'
    return result.stdout + result.stderr


def randomised(model, seed=0):
    """``model`` in eval mode with every parameter random, zero-initialised biases, heads and
    relative position tables included (parameters equal to one stay near one: norm scales)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05 + (param == 1) * 1.0)
    return model.eval()


def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    return [t for item in output for t in _tensors(item)]


def assert_swap_keeps_outputs(model, x, atol=1e-5, device=torch.device('cpu'), phi='none', **swap_options):
    """Swapping ``phi`` ('none', or a Φp that starts at zero: rpb's table, iRPE's tables) into a
    randomised copy of ``model`` changes no output, in eval mode and in train mode (the model must
    have no dropout), both models run on ``device``; returns the swapped copy."""
    import copy
    import posattn
    model = randomised(model).to(device)
    swapped = posattn.swap_attention(copy.deepcopy(model), phi=phi, **swap_options)
    x = x.to(device)
    for training in (False, True):
        model.train(training), swapped.train(training)
        with torch.no_grad():
            expected, got = _tensors(model(x)), _tensors(swapped(x))
        assert len(got) == len(expected) and max(e.abs().max() for e in expected) > 1e-2
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=0, atol=atol)
    return swapped.eval()


def assert_trains_with_every_phi(build_model, x, **swap_options):
    """For every registered Φp: swap it into ``build_model()``, take a training step's backward,
    and check that the loss is finite and every Φp received a gradient."""
    import posattn
    from posattn.swap import SwappedAttention
    for phi in posattn.list_phis():
        torch.manual_seed(0)
        model = posattn.swap_attention(build_model(), phi=phi, **swap_options).train()
        loss = sum(t.float().square().mean() for t in _tensors(model(x)))
        loss.backward()
        assert torch.isfinite(loss), phi
        layers = [m for m in model.modules() if isinstance(m, SwappedAttention)]
        assert layers, phi
        for layer in layers:
            grads = [p.grad for p in layer.phi.parameters()]
            assert all(g is not None and torch.isfinite(g).all() for g in grads), phi
            assert not grads or any(g.abs().sum() > 0 for g in grads), phi


def random_key_mask(layout, generator):
    """A random key mask (B, L) for ``layout`` that keeps each image's first token."""
    mask = torch.rand(layout.num_rows, layout.length, generator=generator) > 0.3
    for row, start in zip(layout.rows, layout.starts):
        mask[row, start] = True
    return mask


def assert_rows_match_each_image(layer, layout, x, upstream, key_mask, inputs, oracle):
    """The layer on ``layout`` against ``oracle(layer, tokens, grid, mask)``, each image alone (float64):
    every image's output, and the gradients of ``inputs`` (x first) of the loss sum(out * upstream),
    to 1e-10."""
    out = layer(x, layout, key_mask)
    got = torch.autograd.grad((out * upstream).sum(), inputs)
    masks = layout.images(key_mask) if key_mask is not None else [None] * layout.num_images
    loss = 0.0
    for tokens, grid, mask, image_upstream, image_out in zip(layout.images(x), layout.grids, masks,
                                                              layout.images(upstream), layout.images(out)):
        expected = oracle(layer, tokens, grid, mask)
        torch.testing.assert_close(image_out, expected, rtol=0, atol=1e-10)
        loss = loss + (expected * image_upstream).sum()
    for grad, expected_grad in zip(got, torch.autograd.grad(loss, inputs)):
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-10)
