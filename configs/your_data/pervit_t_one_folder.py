# PerViT-T on one folder of class folders, {data_root}/<class>/*.jpg: 20% of each class (seeded)
# is held out for validation and testing (ImageFolderSplit). Everything else as
# configs/your_data/pervit_t_image_folder.py.
_base_ = './pervit_t_image_folder.py'
custom_imports = dict(imports=['posattn_openmmlab', 'posattn_openmmlab.image_folder'], allow_failed_imports=False)
train_dataloader = dict(dataset=dict(_delete_=True, type='ImageFolderSplit', data_root={{_base_.data_root}},
                                     split='train', val_fraction=0.2, pipeline={{_base_.train_pipeline}}))
val_dataloader = dict(dataset=dict(_delete_=True, type='ImageFolderSplit', data_root={{_base_.data_root}},
                                   split='val', val_fraction=0.2, pipeline={{_base_.test_pipeline}}))
test_dataloader = val_dataloader
