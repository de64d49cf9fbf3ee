"""Imported first by the launcher's server (``planner.run.forkserver.rank_modules``): the loggers that
warn while torchao is imported (``planner.torch_compat.float8_import_logger_names``: the CUDA
extensions a machine lacks, a registration torch deprecates) set to ERROR in the server and the ranks
it forks, before it imports a transformers model's modules (which import torchao where it is
installed). ``planner plan`` quiets the same loggers around its own imports; a run said them once
per launch.
"""

from __future__ import annotations

import logging

from planner.torch_compat import float8_import_logger_names

for _name in float8_import_logger_names():
    logging.getLogger(_name).setLevel(logging.ERROR)
