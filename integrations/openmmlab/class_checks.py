"""A classifier's number of classes checked against its data before the first step.

A head with fewer outputs than the data has classes fails deep in the loss or the accuracy (or,
with Mixup's one-hot labels, in a shape error); one with more trains on. A validation folder that
lacks a class of the training folder numbers its classes differently, and validates against the
wrong labels without a word. :class:`ClassCountCheck` stops a run before its first training step
(or its first test batch) instead, with an error that names both numbers and the fix.
``tools/train.py`` and ``tools/test.py`` register it on every run: exact where the config states
its number of classes as a setting of its data (``num_classes`` in its ``linked_keys``, as the
configs for your own images do), else only a head with fewer outputs than classes is an error (a
subset of ImageNet's folders may train with the 1000-way head).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper

from .data_checks import describe_dataset

__all__ = ['ClassCountCheck', 'ClassCountMismatch', 'model_class_counts', 'dataset_classes', 'class_count_problems']


class ClassCountMismatch(ValueError):
    """A classifier's numbers of classes and its data's disagree (:class:`ClassCountCheck`)."""


def model_class_counts(model) -> Dict[str, int]:
    """The numbers of classes a classifier states: ``{'model.head.num_classes': n,
    'data_preprocessor.num_classes': n}`` (the second sizes Mixup's and CutMix's one-hot labels);
    the entries it does not state are left out, and a model without a ``head`` (a detector, a
    segmentor) states none."""
    model = model.module if is_model_wrapper(model) else model
    counts = {}
    head_classes = getattr(getattr(model, 'head', None), 'num_classes', None)
    if isinstance(head_classes, int):
        counts['model.head.num_classes'] = head_classes
    preprocessor_classes = getattr(getattr(model, 'data_preprocessor', None), 'num_classes', None)
    if isinstance(preprocessor_classes, int) and counts:
        counts['data_preprocessor.num_classes'] = preprocessor_classes
    return counts


def dataset_classes(dataset) -> Optional[Sequence[str]]:
    """The class names a dataset states in its ``metainfo`` (``CustomDataset``: its sorted class
    folders); None where it states none."""
    classes = (getattr(dataset, 'metainfo', None) or {}).get('classes')
    return None if classes is None else tuple(classes)


def _listed(classes: Sequence[str], limit: int = 8) -> str:
    shown = ', '.join(map(str, classes[:limit]))
    return shown + (f', ... ({len(classes)} in all)' if len(classes) > limit else '')


def class_count_problems(counts: Dict[str, int], datasets: Dict[str, object], fix_option: str,
                         exact: bool = True) -> List[str]:
    """What disagrees between a model's numbers of classes (:func:`model_class_counts`) and the
    classes of its datasets (``{'train_dataloader': dataset, ...}``, the training one first): one
    message per problem, each naming the numbers and the fix.

    Args:
        fix_option: the ``--cfg-options`` text that sets the model's number of classes to ``{n}``.
        exact: True: a number of classes other than the data's is a problem; False: only a smaller
            one (more outputs than classes train on a subset of a larger label set).
    """
    problems = []
    named = {name: (dataset, dataset_classes(dataset)) for name, dataset in datasets.items()}
    named = {name: value for name, value in named.items() if value[1] is not None}
    for name, (dataset, classes) in named.items():
        wrong = {key: count for key, count in counts.items()
                 if count < len(classes) or (exact and count != len(classes))}
        if wrong:
            stated = ' and '.join(f'{key}={count}' for key, count in wrong.items())
            problems.append(f'{name}\'s dataset ({describe_dataset(dataset)}) has {len(classes)} classes '
                            f'({_listed(classes)}), but the model has {stated}: set the number of classes to '
                            f'{len(classes)}, e.g. {fix_option.format(n=len(classes))}')
    if len(named) > 1:
        (first, (first_dataset, first_classes)), *others = named.items()
        for name, (dataset, classes) in others:
            if classes != first_classes:
                only_first = [c for c in first_classes if c not in classes]
                only_here = [c for c in classes if c not in first_classes]
                differences = '; '.join(part for part in (
                    f'only in {first}\'s: {_listed(only_first)}' if only_first else '',
                    f'only in {name}\'s: {_listed(only_here)}' if only_here else '') if part) or 'in another order'
                problems.append(f'{name}\'s dataset ({describe_dataset(dataset)}) has other classes than {first}\'s '
                                f'({describe_dataset(first_dataset)}), so their labels number different classes '
                                f'({differences}): give both the same class folders')
    return problems


class ClassCountCheck(Hook):
    """Raises :class:`ClassCountMismatch` before the first training step (``before_train``: the training and
    validation data) and before the first test batch (``before_test``) where the classifier's
    numbers of classes and its data's disagree (:func:`class_count_problems`).

    Args:
        fix_option: the ``--cfg-options`` text that sets the number of classes to ``{n}``.
        exact: whether any other number of classes than the data's is an error, or only a smaller one.
    """
    priority = 'VERY_HIGH'

    def __init__(self, fix_option: str = 'model.head.num_classes={n} data_preprocessor.num_classes={n}',
                 exact: bool = True):
        self.fix_option, self.exact = fix_option, exact

    def _check(self, runner, loops: Dict[str, object]) -> None:
        counts = model_class_counts(runner.model)
        if not counts:
            return
        datasets = {name: loop.dataloader.dataset for name, loop in loops.items() if loop is not None}
        problems = class_count_problems(counts, datasets, f'--cfg-options {self.fix_option}', self.exact)
        if problems:
            raise ClassCountMismatch('the classifier and its data disagree on the classes:\n  '
                                     + '\n  '.join(problems))

    def before_train(self, runner) -> None:
        self._check(runner, {'train_dataloader': runner.train_loop, 'val_dataloader': runner.val_loop})

    def before_test(self, runner) -> None:
        self._check(runner, {'test_dataloader': runner.test_loop})
