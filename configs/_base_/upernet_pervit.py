# UPerNet (mmseg's R-50 model) with PerViT-T as the backbone: windowed peripheral attention
# (14 x 14 windows, Φp shared by all windows) with global blocks 3, 7, 11, and ViTDet's simple
# feature pyramid (strides 4, 8, 16, 32) from its one stride-16 map in place of ResNet's stages.
_base_ = ['mmseg::_base_/models/upernet_r50.py']

custom_imports = dict(imports=['integrations.openmmlab', 'integrations.openmmlab.segmentation'],
                      allow_failed_imports=False)

channels = 256
model = dict(
    pretrained=None,
    backbone=dict(
        _delete_=True,
        type='PosattnPerViT',
        arch='tiny',
        out_indices=-1,
        drop_path_rate=0.1,
        window_size=14,
        global_blocks=(3, 7, 11),
        with_cp=False),  # no init_cfg: from scratch; the COCO / ADE20K configs add a Pretrained one
    neck=dict(type='PosattnSimpleFPN', in_channels=280, out_channels=channels, num_outs=4),
    decode_head=dict(in_channels=[channels] * 4, in_index=[0, 1, 2, 3]),
    # the auxiliary FCN head reads the stride-16 level, the backbone's own resolution
    auxiliary_head=dict(in_channels=channels, in_index=2),
)
