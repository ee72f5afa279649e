"""The training loaders seen from the guard: each batch's dataset indices, and reading one record again.

Loader level (``torch.utils.data``), no Trainer: ``indices.py`` records which indices a batch
sampler gives, ``loaders.py`` does it per loader of a collection of training loaders, ``readers.py``
reads one record again with the loader's own collate.
"""
