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

A checkpoint that mmengine wrote records the classes of its training data (``meta['dataset_meta']``,
the training dataset's ``metainfo``). Test data whose classes differ (a class folder renamed,
added or missing, or the same classes in another order) number their labels differently from the
model's outputs; with as many classes, the test runs and reports a wrong accuracy.
:class:`TrainedClassesCheck` (``tools/test.py`` registers it) stops the test before its first batch
instead, naming the classes that differ; a checkpoint that records no classes is tested as it is.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper

from .data_checks import describe_dataset

__all__ = ['ClassCountCheck', 'ClassCountMismatch', 'model_class_counts', 'dataset_classes', 'class_count_problems',
           'TrainedClassesCheck', 'TrainedClassesMismatch', 'checkpoint_classes', 'trained_class_problem']


class ClassCountMismatch(ValueError):
    """A classifier's numbers of classes and its data's disagree (:class:`ClassCountCheck`)."""


class TrainedClassesMismatch(ValueError):
    """A checkpoint's classes and its test data's differ (:class:`TrainedClassesCheck`)."""


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


def checkpoint_classes(checkpoint: Any) -> Optional[Tuple[str, ...]]:
    """The class names a checkpoint was trained on, as mmengine's runner records them
    (``meta['dataset_meta']['classes']``: its training dataset's ``metainfo``); None where it
    records none (a checkpoint of another library, a bare state_dict, a dataset without classes)."""
    meta = checkpoint.get('meta') if isinstance(checkpoint, dict) else None
    dataset_meta = meta.get('dataset_meta') if isinstance(meta, dict) else None
    classes = dataset_meta.get('classes') if isinstance(dataset_meta, dict) else None
    return None if classes is None else tuple(classes)


def trained_class_problem(trained: Sequence[str], name: str, dataset, source: str = 'the checkpoint') -> Optional[str]:
    """What differs between the classes a checkpoint was trained on (:func:`checkpoint_classes`) and
    those of a dataset (``name``: its data loader, e.g. ``'test_dataloader'``), with the fix; None
    where they are the same, in the same order, or where the dataset states no classes."""
    classes = dataset_classes(dataset)
    trained = tuple(trained)
    if classes is None or classes == trained:
        return None
    only_trained = [c for c in trained if c not in classes]
    only_here = [c for c in classes if c not in trained]
    differences = '; '.join(part for part in (
        f'only in the checkpoint: {_listed(only_trained)}' if only_trained else '',
        f'only in the test data: {_listed(only_here)}' if only_here else '') if part) \
        or 'the same classes in another order'
    return (f'{source} was trained on {len(trained)} classes ({_listed(trained)}), but {name}\'s dataset '
            f'({describe_dataset(dataset)}) has {len(classes)} ({_listed(classes)}): {differences}. Its labels '
            f'would stand for other classes than the model\'s outputs: test on data with the checkpoint\'s classes, '
            f'in its order (labels number the class folders in sorted order: name them as in the training data)')


class TrainedClassesCheck(Hook):
    """Raises :class:`TrainedClassesMismatch` before the first test batch where the test data's
    classes differ from those the loaded checkpoint was trained on (:func:`trained_class_problem`).
    A checkpoint that records no classes (:func:`checkpoint_classes`) is not checked.

    It holds the classes of the last checkpoint the runner loaded, read when the runner loads it
    (``after_load_checkpoint``), and runs before :class:`ClassCountCheck`, whose fix (another number
    of classes) would not fit the checkpoint.
    """
    priority = 'HIGHEST'

    def __init__(self):
        self.trained_classes: Optional[Tuple[str, ...]] = None  # those of the last checkpoint loaded

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        self.trained_classes = checkpoint_classes(checkpoint)

    def before_test(self, runner) -> None:
        if self.trained_classes is None:
            return
        source = f'checkpoint {runner.cfg.load_from}' if runner.cfg.get('load_from') else 'the checkpoint'
        problem = trained_class_problem(self.trained_classes, 'test_dataloader', runner.test_loop.dataloader.dataset,
                                        source)
        if problem:
            raise TrainedClassesMismatch(f'the checkpoint and the test data disagree on the classes:\n  {problem}')
