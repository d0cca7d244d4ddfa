# The harder embedded benchmark, as data for any *_shapes.py row (tools/compare_phis.py --data, or a
# study's data): PositionalRelations, generated on first use. Three target shapes among outlined
# distractors; the class is which target is leftmost and which topmost (9 classes, chance 11.1%;
# docs/results.md). No flips: both would change the classes. The test split is the validation one;
# tools/test.py --img-size draws its scenes at another scale, --extent on a larger canvas.
dataset_name = 'PositionalRelations'
img_size = 64
num_classes = 9
train_dataloader = dict(
    batch_size=64,
    num_workers=0,
    dataset=dict(type='PositionalRelations', split='train', num_images=6000, img_size=img_size,
                 pipeline=[dict(type='PackInputs')]),
    sampler=dict(type='DefaultSampler', shuffle=True),
)
val_dataloader = dict(
    batch_size=128,
    num_workers=0,
    dataset=dict(type='PositionalRelations', split='val', num_images=1200, img_size=img_size,
                 pipeline=[dict(type='PackInputs')]),
    sampler=dict(type='DefaultSampler', shuffle=False),
)
val_evaluator = dict(type='Accuracy', topk=(1,))
test_dataloader = val_dataloader
test_evaluator = val_evaluator
