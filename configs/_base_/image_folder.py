# Your own images, one folder per class (configs/your_data/; docs/your-data.md):
#   {data_root}/train/<class>/*.jpg and {data_root}/val/<class>/*.jpg  (ImageNet's layout, CustomDataset)
# The class is the folder's name; labels number the folders in sorted order. For one folder of class
# folders, hold out a part of each class instead: configs/your_data/pervit_t_one_folder.py.
# The three settings below are the only place to set them: --cfg-options data_root=... num_classes=...
# img_size=... on tools/train.py, test.py and analyze.py sets every key that uses them (linked_keys).
# A num_classes that differs from the number of class folders stops the training before its first step.
data_root = 'data/mydata'
num_classes = 2  # the number of class folders
img_size = 224  # the training crop; evaluation resizes the short edge to it and crops the centre

data_preprocessor = dict(
    num_classes=num_classes,  # sizes the one-hot labels of Mixup and CutMix
    mean=[123.675, 116.28, 103.53],  # ImageNet's statistics, in RGB
    std=[58.395, 57.12, 57.375],
    to_rgb=True,  # images are read as BGR
)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomResizedCrop', scale=img_size, backend='pillow', interpolation='bicubic'),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='ResizeEdge', scale=img_size, edge='short', backend='pillow', interpolation='bicubic'),
    dict(type='CenterCrop', crop_size=img_size),
    dict(type='PackInputs'),
]
train_dataloader = dict(
    batch_size=64,
    num_workers=4,
    persistent_workers=True,
    dataset=dict(type='CustomDataset', data_root=data_root, data_prefix='train', pipeline=train_pipeline),
    sampler=dict(type='DefaultSampler', shuffle=True),
)
val_dataloader = dict(
    batch_size=64,
    num_workers=4,
    persistent_workers=True,
    dataset=dict(type='CustomDataset', data_root=data_root, data_prefix='val', pipeline=test_pipeline),
    sampler=dict(type='DefaultSampler', shuffle=False),
)
val_evaluator = dict(type='Accuracy', topk=(1,))
test_dataloader = val_dataloader
test_evaluator = val_evaluator
# an image file of 0 bytes (an interrupted copy) stops the run before its first step, named
custom_hooks = [dict(type='EmptyImageCheckHook')]

# The recipe: 'imagenet' (DeiT's: random resized crops, flips, Mixup and CutMix; evaluation resizes
# the short edge and crops the centre) or 'position', for labels that depend on where things are:
# every image resized to img_size x img_size, no crop, no flip, no Mixup or CutMix (a flip swaps
# left and right, a crop moves the object). --cfg-options recipe=position chooses it; the model
# configs add the rest of each recipe (lr, schedule) to its entry in recipes.
recipe = 'imagenet'
position_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=img_size, keep_ratio=False, backend='pillow', interpolation='bicubic'),
    dict(type='PackInputs'),
]
recipes = dict(
    imagenet=dict(),
    position={'train_dataloader.dataset.pipeline': position_pipeline,
              'val_dataloader.dataset.pipeline': position_pipeline,
              'test_dataloader.dataset.pipeline': position_pipeline},
)

# {top-level setting: the keys that use its value}: the tools set these keys from the setting given
# with --cfg-options, and refuse a config in which one differs from its setting. A pipeline's
# transform is named by its type, so that each recipe's transforms are linked.
linked_keys = dict(
    data_root=['train_dataloader.dataset.data_root', 'val_dataloader.dataset.data_root',
               'test_dataloader.dataset.data_root'],
    num_classes=['data_preprocessor.num_classes', 'model.head.num_classes'],
    img_size=[f'{loader}.dataset.pipeline.{transform}.{key}' for loader in ('train_dataloader', 'val_dataloader',
                                                                           'test_dataloader')
              for transform, key in (('RandomResizedCrop', 'scale'), ('ResizeEdge', 'scale'),
                                     ('CenterCrop', 'crop_size'), ('Resize', 'scale'))],
)
