"""FedAvg (McMahan et al. 2017): every trainable key travels; the server takes the sample-weighted mean."""
from .base import Algorithm, register


@register
class FedAvg(Algorithm):
    name = "fedavg"
