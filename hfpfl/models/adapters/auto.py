"""Load any saved adapter folder onto a base model, whichever library wrote it: hfpfl's residual/parallel adapters
(:class:`~hfpfl.models.adapters.model.ConvAdapterModel`) or peft's (``PeftModel``), as peft's ``AutoPeftModel``
picks the class from the folder's config."""
from __future__ import annotations

import os

from torch import nn

from .config import CONFIG_NAME
from .io import resolve_adapter_folder
from .model import ConvAdapterModel


def load_adapter(base_model: nn.Module, path: str, adapter_name: str = "default", is_trainable: bool = False,
                 **kwargs):
    """Load any saved adapter folder onto ``base_model``: an hfpfl residual/parallel adapter
    (:meth:`ConvAdapterModel.from_pretrained`) or a peft adapter (``PeftModel.from_pretrained``), with a clear
    ValueError when it does not fit the base model."""
    folder = resolve_adapter_folder(path, revision=kwargs.pop("revision", None), cache_dir=kwargs.pop("cache_dir", None))
    if os.path.isfile(os.path.join(folder, CONFIG_NAME)):
        return ConvAdapterModel.from_pretrained(base_model, folder, adapter_name=adapter_name, is_trainable=is_trainable)
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(base_model, folder, adapter_name=adapter_name, is_trainable=is_trainable,
                                         **kwargs)
    except RuntimeError as e:
        if "size mismatch" in str(e):
            raise ValueError(f"adapter at {path} does not fit this base model: {e}") from e
        raise
