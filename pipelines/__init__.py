"""diffusers pipelines of hfpfl (one file per pipeline, inference only)."""

from .pipeline_fedbip import FedBiPPipeline, FedBiPPipelineOutput

__all__ = ["FedBiPPipeline", "FedBiPPipelineOutput"]
