"""The built-in model names, without importing the builders (transformers' model code): the run header and the
option checks need only the names."""
TINY_CLASSIFIER_NAMES = ("tiny-resnet", "tiny-vit", "resnet-18", "resnet-26")
TINY_VQA_MODELS = ("tiny-vilt", "tiny-blip")
