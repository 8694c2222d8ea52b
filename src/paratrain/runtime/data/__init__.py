"""Input pipelines: the byte corpus of the GPT runs (:mod:`.text`) and the image pipeline, its
caches and the data-stall tools (DS-Analyzer, CoorDL) beside it."""

from .text import MLM_MASK_FRACTION, Batch, Corpus, DataSource, load_corpus, stdlib_dir

__all__ = ["Corpus", "Batch", "DataSource", "load_corpus", "stdlib_dir", "MLM_MASK_FRACTION"]
