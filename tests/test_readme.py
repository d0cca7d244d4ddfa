"""Every command and code block of the README runs as written and prints what the README shows."""
import contextlib
import copy
import io
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from posattn.reference import peripheral_attention, peripheral_position_attention

from conftest import REPO

README = REPO / 'README.md'

# What each make target of the README must run, after setting up the environment.
MAKE_TARGET_COMMANDS = {
    'run': '.venv/bin/python tools/train.py configs/pervit_t_shapes.py',
    'test': ("OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m 'environment or not environment' -n auto "
             '--dist loadfile --no-loadscope-reorder --durations=25'),
}


def fenced_blocks(language):
    return re.findall(rf'```{language}\n(.*?)```', README.read_text(), flags=re.S)


def shell_commands():
    """The README's shell lines, comments removed."""
    return [line.split('#')[0].strip() for block in fenced_blocks('bash') for line in block.splitlines()
            if line.split('#')[0].strip()]


@pytest.fixture(scope='module')
def quick_start():
    """The quick start block run as written: its namespace and the lines it printed."""
    (block,) = fenced_blocks('python')
    namespace, printed = {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, 'README.md', 'exec'), namespace)
    return block, namespace, printed.getvalue().splitlines()


def test_quick_start_prints_what_the_readme_shows(quick_start):
    block, _, printed = quick_start
    shown = re.findall(r'# -> (.*)$', block, flags=re.M)
    assert len(shown) == 4 and printed == shown


def test_quick_start_layer_is_pervits_peripheral_attention(quick_start):
    """The layer's output is PerViT's peripheral attention (the release's formula, float64)."""
    _, namespace, _ = quick_start
    out, layer = namespace['out'], copy.deepcopy(namespace['layer']).double()
    with torch.no_grad():
        phi = peripheral_position_attention(14, 20, layer.phi.weights())  # (4, 280, 280)
        expected = peripheral_attention(namespace['x'].double(), layer.qkv.weight, layer.qkv.bias, layer.proj.weight,
                                        layer.proj.bias, 4, phi, num_prefix_tokens=1)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


def test_quick_start_cached_inference_gives_the_uncached_logits(quick_start):
    _, namespace, _ = quick_start
    with torch.no_grad():
        uncached = namespace['model'](namespace['images'])
    torch.testing.assert_close(namespace['logits'], uncached, rtol=1e-5, atol=1e-6)


def test_readme_shell_commands_are_all_checked():
    commands = shell_commands()
    assert commands, 'the README shows no shell command'
    for command in commands:
        words = shlex.split(command)
        assert words[:1] == ['make'] and words[1] in MAKE_TARGET_COMMANDS or words[:2] == ['pip', 'install'], (
            f'{command!r}: a README command that no test checks; add a check to tests/test_readme.py')


@pytest.mark.parametrize('target', sorted(MAKE_TARGET_COMMANDS))
def test_make_targets_set_up_dot_venv_then_run_their_command(target):
    """`make -n -B` prints every step without running any: the environment made as .venv, the
    install into it, then the target's own command, last."""
    assert any(shlex.split(c) == ['make', target] for c in shell_commands())
    # as a user's shell runs it: not as a sub-make of `make test`, whose variables would change what it prints
    env = {key: value for key, value in os.environ.items() if key not in ('MAKEFLAGS', 'MFLAGS', 'MAKELEVEL')}
    result = subprocess.run(['make', '--no-print-directory', '-n', '-B', target], cwd=REPO, capture_output=True,
                            text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    steps = result.stdout.strip().splitlines()
    assert any(re.fullmatch(r'\S*python\S* -m venv \.venv', step) for step in steps), steps
    assert any(step.startswith('.venv/bin/python -m pip install') and "-e '.[test,mm,analysis,hf]'" in step
               for step in steps), steps
    assert steps[-1] == MAKE_TARGET_COMMANDS[target]
    assert (REPO / 'configs' / 'pervit_t_shapes.py').is_file()


def pyproject_extras():
    section = (REPO / 'pyproject.toml').read_text().split('[project.optional-dependencies]')[1].split('\n[')[0]
    return set(re.findall(r'^([a-z][\w-]*) = \[', section, flags=re.M))


@pytest.mark.parametrize('command', [c for c in shell_commands() if c.startswith('pip install')])
def test_pip_lines_resolve_to_this_package_and_its_extras(command):
    """pip resolves each line to posattn with the extras it names, offline and installing nothing."""
    (target,) = shlex.split(command)[2:]
    result = subprocess.run([sys.executable, '-m', 'pip', 'install', '--dry-run', '--no-deps', '--no-index',
                             '--no-build-isolation', '--quiet', '--report', '-', target],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (install,) = json.loads(result.stdout)['install']
    assert install['metadata']['name'] == 'posattn'
    requested = set(install.get('requested_extras') or ())
    assert requested == set(re.findall(r'\[(.*)\]', target)[0].split(',') if '[' in target else ())
    assert requested <= set(install['metadata']['provides_extra']) == pyproject_extras()


def test_install_section_names_every_extra():
    install = README.read_text().split('## Install')[1].split('\n## ')[0]
    for extra in pyproject_extras():
        assert re.search(rf'\b{extra}\b', install), f'the README does not name the extra {extra!r}'


def test_readme_sends_each_user_to_a_page_that_exists():
    pages = set(re.findall(r'\]\((docs/[\w-]+\.md)\)', README.read_text()))
    assert len(pages) >= 10
    missing = sorted(p for p in pages if not (REPO / p).is_file())
    assert not missing, missing
