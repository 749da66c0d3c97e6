"""``fb.Pipeline`` and ``fb.PipelineLoss``: pipeline parallelism with exact optimizer steps.

Modules: ``_pipeline`` (the pipeline, its loss and its window), ``_scale`` (GradScaler steps for
pipeline windows). See docs/distributed.md ("Pipeline parallelism").
"""

from __future__ import annotations

from fullbatch._pipeline._pipeline import Pipeline, PipelineLoss, PipelineWindow

__all__ = ["Pipeline", "PipelineLoss", "PipelineWindow"]
