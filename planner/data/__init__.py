"""Real text for ``planner run PLAN --data PATH``: a corpus as batches in the model's own format.

``TextBatches`` reads a text file (or a folder of ``.txt`` files), tokenises it (``char``, ``byte``
or ``word``), holds out the end for evaluation, and streams the tutorials' batchify + bptt windows,
sharded per data-parallel replica, through a torchdata ``StatefulDataLoader`` so that a run
resumes at the exact next batch. See docs/data.md.
"""

from planner.data.batches import TextBatches, TokenBatchFormat, token_batch_format
from planner.data.text import DEFAULT_CORPUS, TOKENIZERS, Vocab

__all__ = ["DEFAULT_CORPUS", "TOKENIZERS", "TextBatches", "TokenBatchFormat", "Vocab", "token_batch_format"]
